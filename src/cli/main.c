/*
 * main.c — the `meshdit` command (contract: DESIGN.md §4): dispatch and usage.
 *
 *   gen      random-weight checkpoint                       cmd_gen.c
 *   inputs   random inputs of a checkpoint's model          cmd_gen.c
 *   run      forwards or the sampler, the report            cmd_run.c
 *   compare  per-tensor differences of two files            cmd_compare.c
 *   gather   TP shards back into one checkpoint             cmd_compare.c
 *   inspect  weight table, shards and ranks of a layout     cmd_inspect.c
 *   plan     the scaling model's estimate of every layout   cmd_plan.c
 *   serve    the resident server over ZeroMQ                cmd_serve.c
 *
 * The only code that calls MPI_Init/Finalize and exit(), and the only file of the command that
 * uses MPI; the commands use the library through meshdit.h alone. Library failures come back as
 * status codes; the commands print one line per failure ("meshdit: error: ...") from rank 0.
 * Exit codes: 0 success, 1 failure or comparison beyond tolerance, 2 usage error.
 */
#define _POSIX_C_SOURCE 200809L
#include "cli/cli.h"

#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int cli_rank = 0, cli_world = 1;

void cli_usage(FILE *fp) {
    fprintf(
        fp,
        "usage: meshdit <command> [options]\n"
        "  gen     --model flux|flux2|minimax-h3|qwenimage|wan (--preset NAME | --config FILE)\n"
        "          --out DIR\n"
        "          [--seed N] [--dtype f32|bf16|f16] [--shards K]\n"
        "  inputs  --checkpoint DIR --out FILE [--seed N] [--img-tokens N] [--txt-tokens N]\n"
        "          [--batch N] [--timestep T] [--guidance G] [--audio-tokens N] [--negative]\n"
        "  run     --checkpoint DIR --inputs FILE --out FILE [--steps N] [--repeat N]\n"
        "          [--guidance-scale S]   (guided steps: the inputs' negative_ tensors)\n"
        "          [--cfg 1|2 --tp T --ring R --ulysses U] [--mesh-order cfg,tp,ring,ulysses]\n"
        "          [--report FILE.json] [--max-memory SIZE] [--step-timeout S] [--quiet]\n"
        "          [--device cpu|cuda] [--dtype f32|bf16] [--comm auto|mpi|nccl]\n"
        "          [--lora FILE[:SCALE]]...   (docs/lora.md)\n"
        "          [--cache first_block[:threshold=X] | mag:mag_ratios=A/B/...[,...] |\n"
        "                   taylorseer[:cache_interval=N,...] | text_kv]\n"
        "                                            (with --steps; docs/cache.md)\n"
        "  compare A.safetensors B.safetensors [--tol X]   (B is the reference)\n"
        "  inspect (--checkpoint DIR | --config FILE) [--cfg C --tp T --ring R --ulysses U]\n"
        "          [--mesh-order ORDER] [--lora FILE[:SCALE]]...\n"
        "  gather  --checkpoint DIR --out DIR [--tp T]   (under mpiexec -n T)\n"
        "  plan    (--checkpoint DIR | --config FILE) --devices N [--device cpu|h100|h200|trn2]\n"
        "          [--device-file FILE] [--device-mem GiB] [--tokens S] [--txt-tokens L]\n"
        "          [--bytes 2|4]\n"
        "  plan    (--checkpoint DIR | --config FILE) --calibrate FILE [--tokens S]\n"
        "          (under mpiexec, placed as the job will be: measures this machine)\n"
        "  serve   --checkpoint DIR [--listen ipc://PATH|tcp://HOST:PORT] [--listen-any]\n"
        "          [--cfg 1|2 --tp T --ring R --ulysses U] [--mesh-order O] [--device cpu|cuda]\n"
        "          [--dtype f32|bf16] [--comm auto|mpi|nccl] [--max-memory SIZE]\n"
        "          [--max-sessions N] [--max-session-bytes SIZE] [--session-idle S]\n"
        "          [--max-request-bytes SIZE] [--max-queue-bytes SIZE]\n"
        "          [--step-timeout S] [--load-timeout S] [--owner-stdin]\n"
        "          [--handshake-timeout S] [--message-timeout S] [--min-rate BYTES]\n"
        "          [--lora FILE[:SCALE]]...   (docs/serve.md)\n");
}

/* The launcher forwards a rank's stdout and stderr through pipes, and on MPI_Abort it kills every
 * rank and may exit before it has drained those pipes: the one error line just printed was lost
 * that way under CI's MPICH (Hydra). So the line is flushed and the launcher given half a second
 * to forward it before the job is ended; the job is failing anyway, and its peers are stuck. */
void cli_abort_job(int code) {
    fflush(stdout);
    fflush(stderr);
    const struct timespec wait = {0, 500000000};
    nanosleep(&wait, NULL);
    MPI_Abort(MPI_COMM_WORLD, code);
}

static const struct {
    const char *name;
    int (*fn)(int argc, char **argv);
    int serial; /* one process's work: under mpiexec -n N rank 0 does it, the others nothing */
} k_commands[] = {{"gen", cmd_gen, 1},         {"inputs", cmd_inputs, 1},
                  {"run", cmd_run, 0},         {"compare", cmd_compare, 1},
                  {"inspect", cmd_inspect, 1}, {"gather", cmd_gather, 0},
                  {"plan", cmd_plan, 0},       {"serve", cmd_serve, 0}};

static int dispatch(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        cli_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
        if (strcmp(argv[1], k_commands[i].name) == 0) /* not N copies writing the same files */
            return k_commands[i].serial && cli_rank != 0 ? 0 : k_commands[i].fn(argc - 2, argv + 2);
    if (strcmp(argv[1], "--version") == 0) {
        printf("meshdit %d.%d.%d\n", MDT_VERSION_MAJOR, MDT_VERSION_MINOR, MDT_VERSION_PATCH);
        return 0;
    }
    return cli_usage_exit("unknown command '%s'", argv[1]);
}

int main(int argc, char **argv) {
    if (MPI_Init(&argc, &argv) != MPI_SUCCESS) {
        fprintf(stderr, "meshdit: error: MPI_Init failed\n");
        return 1;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &cli_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &cli_world);
    if (cli_world > 1)
        mdt_set_log_rank(cli_rank);
    cli_test_env_install();
    int rc;
    /* MESHDIT_CPU_ISA or MESHDIT_CPU_GEMM that a rank's CPU cannot run is an error on every
     * rank, never ignored; the lowest failing rank says why */
    const mdt_status st = mdt_world_agree(
        mdt_cpu_kernels_select(getenv("MESHDIT_CPU_ISA"), getenv("MESHDIT_CPU_GEMM")));
    rc = st != MDT_OK ? cli_fail_exit(st) : dispatch(argc, argv);
    MPI_Finalize();
    return rc == CLI_HELP_SHOWN ? 0 : rc;
}
