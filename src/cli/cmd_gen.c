/*
 * cmd_gen.c — `meshdit gen` (a random-weight checkpoint of a preset or a config) and
 * `meshdit inputs` (random inputs of a checkpoint's model).
 */
#include "cli/cli.h"

#include <stdint.h>
#include <string.h>

int cmd_gen(int argc, char **argv) {
    cli_opts o;
    long long seed, shards;
    int rc = cli_parse_opts(argc, argv, &o, NULL);
    if (rc)
        return rc;
    const char *model_given = cli_opt_str(&o, "model", NULL),
               *preset = cli_opt_str(&o, "preset", NULL);
    const char *model = model_given ? model_given : "flux";
    const char *cfg = cli_opt_str(&o, "config", NULL), *out = cli_opt_str(&o, "out", NULL);
    const char *dts = cli_opt_str(&o, "dtype", "f32");
    if ((rc = cli_opt_int(&o, "seed", 0, 0, INT64_MAX, &seed)) ||
        (rc = cli_opt_int(&o, "shards", 1, 1, 99999, &shards)) || (rc = cli_opts_check_unused(&o)))
        return rc;
    if (!out)
        return cli_usage_exit("gen needs --out DIR");
    if (!!preset == !!cfg)
        return cli_usage_exit("gen needs exactly one of --preset NAME or --config FILE");
    mdt_dtype dt = strcmp(dts, "f32") == 0    ? MDT_F32
                   : strcmp(dts, "bf16") == 0 ? MDT_BF16
                   : strcmp(dts, "f16") == 0  ? MDT_F16
                                              : MDT_DTYPE_COUNT;
    if (dt == MDT_DTYPE_COUNT)
        return cli_usage_exit("--dtype must be f32, bf16 or f16, got '%s'", dts);
    char known[512], msg[640];
    if (preset && !mdt_family_exists(model)) {
        mdt_family_names(known, sizeof known);
        snprintf(msg, sizeof msg, "unknown --model '%%s' (supported: %s)", known);
        return cli_usage_exit(msg, model);
    }
    if (preset && !mdt_family_has_preset(model, preset)) {
        mdt_preset_names(known, sizeof known);
        snprintf(msg, sizeof msg, "unknown --preset '%%s' (%s)", known);
        return cli_usage_exit(msg, preset);
    }
    mdt_status st = mdt_checkpoint_gen(preset ? model : model_given, preset, preset ? NULL : cfg,
                                       (uint64_t)seed, dt, (int)shards, out);
    if (st != MDT_OK)
        return cli_fail_exit(st);
    printf("wrote %s (seed %lld, %s, %lld shard%s)\n", out, seed, dts, shards,
           shards > 1 ? "s" : "");
    return 0;
}

int cmd_inputs(int argc, char **argv) {
    cli_opts o;
    static const char *const flags[] = {"negative", NULL};
    long long seed, img, txt, batch, audio;
    double t, g;
    int rc = cli_parse_opts(argc, argv, &o, flags);
    if (rc)
        return rc;
    const char *ck = cli_opt_str(&o, "checkpoint", NULL), *out = cli_opt_str(&o, "out", NULL);
    const int negative = cli_opt_str(&o, "negative", NULL) != NULL;
    /* options a family may not take: given, they must show in the inputs made */
    const int g_given = cli_opt_str(&o, "guidance", NULL) != NULL,
              a_given = cli_opt_str(&o, "audio-tokens", NULL) != NULL;
    if ((rc = cli_opt_int(&o, "seed", 0, 0, INT64_MAX, &seed)) ||
        (rc = cli_opt_int(&o, "img-tokens", 16, 1, 1 << 24, &img)) ||
        (rc = cli_opt_int(&o, "txt-tokens", 8, 1, 1 << 24, &txt)) ||
        (rc = cli_opt_int(&o, "batch", 1, 1, 4096, &batch)) ||
        (rc = cli_opt_int(&o, "audio-tokens", 6, 1, 1 << 24, &audio)) ||
        (rc = cli_opt_double(&o, "timestep", 1.0, &t)) ||
        (rc = cli_opt_double(&o, "guidance", 3.5, &g)) || (rc = cli_opts_check_unused(&o)))
        return rc;
    if (!ck || !out)
        return cli_usage_exit("inputs needs --checkpoint DIR and --out FILE");
    mdt_model_info *info = NULL;
    mdt_tensor_set *set = NULL;
    mdt_status st = mdt_model_info_open(ck, NULL, 0, &info);
    if (st == MDT_OK)
        st = mdt_tensor_set_create(&set);
    if (st == MDT_OK)
        st = mdt_output_check(out);
    if (st == MDT_OK)
        st = mdt_output_not_input("--out", out, ck, NULL, 0);
    if (st == MDT_OK) {
        const mdt_random_inputs p = {.seed = (uint64_t)seed,
                                     .batch = batch,
                                     .img_tokens = img,
                                     .txt_tokens = txt,
                                     .timestep = t,
                                     .guidance = g,
                                     .audio_tokens = audio,
                                     .negative = negative};
        st = mdt_model_info_make_inputs(info, &p, set);
    }
    if (st == MDT_OK) { /* an option the model has no input for is refused, never dropped */
        const char *cls = mdt_model_info_class_name(info);
        int has_neg = 0;
        for (int i = 0; i < mdt_tensor_set_count(set); i++) {
            const char *name;
            mdt_tensor_set_at(set, i, &name);
            has_neg |= strncmp(name, "negative_", 9) == 0;
        }
        if (negative && !has_neg)
            st = mdt_error_set(MDT_E_INVALID,
                               "--negative: %s has no unconditional branch (its pipeline does not "
                               "guide), so there are no negative_ inputs to draw",
                               cls);
        else if (g_given && !mdt_tensor_set_get(set, "guidance"))
            st = mdt_error_set(MDT_E_INVALID,
                               "--guidance: this %s takes no guidance input (its config has no "
                               "guidance_embeds)",
                               cls);
        else if (a_given && !mdt_tensor_set_get(set, "audio_hidden_states"))
            st = mdt_error_set(MDT_E_INVALID, "--audio-tokens: %s has no audio stream", cls);
    }
    if (st == MDT_OK)
        st = mdt_outputs_write(out, set, NULL, NULL);
    mdt_tensor_set_free(set);
    mdt_model_info_free(info);
    if (st != MDT_OK)
        return cli_fail_exit(st);
    printf("wrote %s (seed %lld, batch %lld, %lld image + %lld text tokens%s)\n", out, seed, batch,
           img, txt, negative ? ", with the unconditional branch's negative_ inputs" : "");
    return 0;
}
