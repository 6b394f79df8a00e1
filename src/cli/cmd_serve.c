/*
 * cmd_serve.c — `meshdit serve`: the mesh, the device, the endpoint bound on rank 0 before any
 * weight is read (a busy port or a missing directory costs no load), the load once, then the
 * library's server (mdt_serve, docs/serve.md) until a "close" request or SIGTERM/SIGINT on any
 * rank (exit 0). Rank 0 prints "serving on ENDPOINT" once the model is loaded, so that a script
 * can wait for that line.
 */
#define _POSIX_C_SOURCE 200809L
#include "cli/cli.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t g_signal, g_signal_pid; /* the stop signal and its sender */

static void on_signal(int sig, siginfo_t *info, void *ctx) {
    (void)ctx;
    if (!g_signal)
        g_signal = sig, g_signal_pid = info ? (sig_atomic_t)info->si_pid : 0;
    mdt_serve_stop(); /* a flag: every rank leaves the loop within about a second */
}

/* Rank 0, after a stop: one line saying why, so that whoever watches the job's output (the
 * Python package's Server) can say what happened. A close request needs none. */
static void say_why_stopped(const mdt_serve_listener *l) {
    if (mdt_serve_listener_owner_gone(l))
        fprintf(stderr, "meshdit: serve: stopped: its standard input ended (--owner-stdin: the "
                        "process that started the server is gone)\n");
    else if (g_signal)
        fprintf(stderr, "meshdit: serve: stopped by %s from process %ld\n",
                g_signal == SIGTERM ? "SIGTERM" : "SIGINT", (long)g_signal_pid);
    fflush(stderr);
}

/* The listener's thread: a request outlived a stop's grace; its client has the reason. */
static void on_stop_stuck(void *user, const char *msg) {
    (void)user;
    cli_print_error(msg);
    _exit(1); /* the launcher ends the other ranks */
}

static void on_ready(void *user, const char *endpoint) {
    (void)user;
    printf("serving on %s\n", endpoint);
    fflush(stdout);
}

typedef struct serve_args {
    const char *ck, *listen;
    int listen_any, owner_stdin;
    cli_layout l;
    long long max_sessions, step_timeout, load_timeout, session_idle;
    int64_t max_session_bytes, max_request_bytes, max_queue_bytes, min_rate;
    double handshake_timeout, message_timeout;
    const char *lora[16]; /* --lora FILE[:SCALE], repeatable */
    int nlora;
} serve_args;

/* A number of seconds (--handshake-timeout 0.5) in [0, 1 day] into *out, `def` when absent. */
static int opt_seconds(cli_opts *o, const char *key, double def, double *out) {
    const int rc = cli_opt_double(o, key, def, out);
    if (rc == 0 && !(*out >= 0 && *out <= 86400)) {
        char msg[96], v[32];
        snprintf(msg, sizeof msg, "--%s takes seconds from 0 to 86400, got '%%s'", key);
        snprintf(v, sizeof v, "%g", *out);
        return cli_usage_exit(msg, v);
    }
    return rc;
}

/* 1 when `v` is a size of zero in any spelling mdt_size_parse takes for a positive one ("0",
 * "00", "0K", "0.0MiB", "0e-1G"): --min-rate 0K means none, as 0 does. Not a negative zero, nor
 * a positive number too small for a double ("0.000...1K" is not zero: it is refused). */
static int size_is_zero(const char *v) {
    char *end, one[48];
    const double x = strtod(v, &end);
    const char *s = v;
    if (end == v || x != 0 || !(*s >= '0' && *s <= '9') || strpbrk(v, "xX") || strlen(end) > 16)
        return 0; /* a plain decimal, as mdt_size_parse takes: no blanks, sign or hex */
    for (const char *p = s; p < end && !strchr("eEpP", *p); p++) /* the mantissa's digits */
        if (*p >= '1' && *p <= '9')
            return 0;
    snprintf(one, sizeof one, "1%s", end); /* the unit, on a positive number */
    return mdt_size_parse(one) > 0;
}

/* A size option (--max-session-bytes 1G) into *out, `def` when absent; `zero_ok`: "0" too. */
static int opt_size(cli_opts *o, const char *key, int64_t def, int zero_ok, int64_t *out) {
    const char *v = cli_opt_str(o, key, NULL);
    *out = def;
    if (v && zero_ok && size_is_zero(v))
        *out = 0;
    else if (v && (*out = mdt_size_parse(v)) <= 0) {
        char msg[96];
        snprintf(msg, sizeof msg, "--%s takes a size like 512M, 8G or 1048576%s, got '%%s'", key,
                 zero_ok ? " (or 0)" : "");
        return cli_usage_exit(msg, v);
    }
    return 0;
}

static int parse_serve(int argc, char **argv, serve_args *a) {
    static const char *const flags[] = {"listen-any", "owner-stdin", NULL};
    cli_opts o;
    int rc = cli_parse_opts(argc, argv, &o, flags);
    if (rc)
        return rc;
    const mdt_serve_params def = mdt_serve_params_default();
    a->ck = cli_opt_str(&o, "checkpoint", NULL);
    a->listen = cli_opt_str(&o, "listen", NULL);
    a->listen_any = cli_opt_str(&o, "listen-any", NULL) != NULL;
    a->nlora = cli_opt_all(&o, "lora", a->lora, 16);
    if (a->nlora > 16)
        return cli_usage_exit("at most 16 --lora adapters, got %d", a->nlora);
    a->owner_stdin = cli_opt_str(&o, "owner-stdin", NULL) != NULL;
    if ((rc = cli_parse_layout(&o, &a->l)) ||
        (rc = cli_opt_int(&o, "max-sessions", def.max_sessions, 0, 4096, &a->max_sessions)) ||
        (rc = opt_size(&o, "max-session-bytes", def.max_session_bytes, 0, &a->max_session_bytes)) ||
        (rc = opt_size(&o, "max-request-bytes", def.max_request_bytes, 0, &a->max_request_bytes)) ||
        (rc = opt_size(&o, "max-queue-bytes",
                       a->max_request_bytes > INT64_MAX / 2 ? INT64_MAX : 2 * a->max_request_bytes,
                       0, &a->max_queue_bytes)) ||
        (rc = cli_opt_int(&o, "step-timeout", 0, 1, 86400 * 7, &a->step_timeout)) ||
        (rc = cli_opt_int(&o, "load-timeout", 600, 0, 86400 * 7, &a->load_timeout)) ||
        (rc = cli_opt_int(&o, "session-idle", (long long)def.session_idle, 0, 86400 * 7,
                          &a->session_idle)) ||
        (rc = opt_seconds(&o, "handshake-timeout", def.handshake_timeout, &a->handshake_timeout)) ||
        (rc = opt_seconds(&o, "message-timeout", def.message_timeout, &a->message_timeout)) ||
        (rc = opt_size(&o, "min-rate", def.min_rate, 1, &a->min_rate)) ||
        (rc = cli_opts_check_unused(&o)))
        return rc;
    if (!a->ck)
        return cli_usage_exit("serve needs --checkpoint DIR");
    if (a->max_queue_bytes < a->max_request_bytes) /* such a request could only hear "busy" */
        return cli_usage_exit("--max-queue-bytes %lld is less than --max-request-bytes %lld: a "
                              "request the server takes must fit the bytes it holds at once",
                              (long long)a->max_queue_bytes, (long long)a->max_request_bytes);
    return 0;
}

int cmd_serve(int argc, char **argv) {
    serve_args a = {0};
    int rc = parse_serve(argc, argv, &a);
    if (rc)
        return rc;
    mdt_mesh *mesh = NULL;
    mdt_model *m = NULL;
    mdt_tensor_set *none = NULL;
    mdt_serve_listener *listener = NULL;
    const mdt_layout lay = cli_mesh_layout(&a.l);
    mdt_status st = mdt_mesh_create_world(&lay, &mesh);
    if (st != MDT_OK)
        return cli_fail_exit(st);
    mdt_serve_params p = mdt_serve_params_default();
    p.endpoint = a.listen, p.listen_any = a.listen_any, p.owner_stdin = a.owner_stdin;
    p.max_sessions = (int)a.max_sessions, p.max_session_bytes = a.max_session_bytes;
    p.session_idle = (double)a.session_idle;
    p.max_request_bytes = a.max_request_bytes, p.max_queue_bytes = a.max_queue_bytes;
    p.step_timeout = (double)a.step_timeout;
    p.handshake_timeout = a.handshake_timeout, p.message_timeout = a.message_timeout;
    p.min_rate = a.min_rate;
    p.max_memory = a.l.max_bytes; /* every forward checked: --max-memory, else run's default */
    p.mem_available = getenv("MESHDIT_MEM_AVAILABLE");
    p.on_stop_stuck = cli_rank == 0 ? on_stop_stuck : NULL;
    /* the endpoint is rank 0's, bound now: a refused one costs no load */
    st = mdt_mesh_agree(mesh, cli_rank == 0 ? mdt_serve_listen(&p, &listener) : MDT_OK);
    /* the load is watched: a rank that stops or hangs in it ends the job with one line naming
     * it within --load-timeout (a server nobody watches must not hang forever half-loaded) */
    mdt_mesh_watch(mesh, (double)a.load_timeout, "--load-timeout");
    if (st == MDT_OK)
        st = mdt_device_select(mesh, a.l.device, a.l.dtype, a.l.comm);
    if (st == MDT_OK) /* no inputs yet: the memory check counts the weights */
        st = mdt_mesh_agree(mesh, mdt_tensor_set_create(&none));
    double load_s = 0;
    if (st == MDT_OK)
        st = cli_load_model(&a.l, a.ck, mesh, none, &m, &load_s);
    double lora_s = 0;
    if (st == MDT_OK && a.nlora) /* fused before the first request */
        st = cli_load_loras(m, a.lora, a.nlora, &lora_s);
    mdt_mesh_watch(mesh, 0, NULL); /* the server arms its own bound */
    if (st == MDT_OK) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_signal; /* no SA_RESTART: a wait returns and sees the flag */
        sa.sa_flags = SA_SIGINFO;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGINT, &sa, NULL);
        p.listener = listener;
        p.on_ready = cli_rank == 0 ? on_ready : NULL;
        st = mdt_serve(m, &p);
        if (st == MDT_OK && cli_rank == 0)
            say_why_stopped(listener);
    }
    if (st != MDT_OK && mdt_mesh_peers_stuck(mesh)) {
        if (st == MDT_E_STOPPED && cli_rank != 0) { /* rank 0 answers and reports it: give */
            const struct timespec t = {3, 0};       /* it the time (its note arrived) */
            nanosleep(&t, NULL);
        }
        cli_print_error(mdt_last_error());
        mdt_serve_listener_free(listener); /* the replies are written; the socket file goes */
        cli_abort_job(1);
    }
    mdt_serve_listener_free(listener); /* closes the clients, removes the socket file */
    mdt_tensor_set_free(none);
    mdt_model_free(m);
    mdt_mesh_free(mesh);
    return st == MDT_OK ? 0 : cli_fail_exit(st);
}
