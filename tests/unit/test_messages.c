/*
 * test_messages.c — messages that used to mislead: a JSON syntax error placed at its real line,
 * column and byte (config.json, index, safetensors header), `"_class_name": 5` called a wrong type
 * rather than a missing key, and an input whose dtype cannot be read as numbers named with its
 * tensor and dtype.
 */
#define _POSIX_C_SOURCE 200809L
#include "harness.h"
#include "io/checkpoint.h"
#include "models/inputs.h"
#include "models/model.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[64];

static const char *write_file(const char *name, const char *text, size_t n) {
    static char path[128];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    FILE *fp = fopen(path, "wb");
    fwrite(text, 1, n, fp);
    fclose(fp);
    return path;
}

static void test_json_positions(void) {
    cJSON *j = NULL;
    /* the second comma on line 3 (byte 40) */
    const char *cfg = "{\n  \"_class_name\": \"FluxTransformer2DModel\",\n  \"axes\": [1,,2]\n}\n";
    EXPECT_ERR(mdt_config_load(write_file("config.json", cfg, strlen(cfg)), &j), MDT_E_FORMAT,
               "config.json: invalid JSON near line 3, column 14 (byte 58)");
    EXPECT(cfg[58] == ',' && cfg[57] == ',', "the test's own offsets");
    const char *trail = "{\"a\": 1}\n\n  x";
    EXPECT_ERR(mdt_config_load(write_file("trail.json", trail, strlen(trail)), &j), MDT_E_FORMAT,
               "bytes other than white space after the JSON, at line 3, column 3 (byte 12)");
    /* valid JSON nested past cJSON's limit: named as the nesting, not as invalid JSON */
    char deep[2100];
    int k = 0;
    k += snprintf(deep + k, sizeof deep - (size_t)k, "{\"a\": ");
    for (int i = 0; i < 1001; i++)
        deep[k++] = '[';
    for (int i = 0; i < 1001; i++)
        deep[k++] = ']';
    k += snprintf(deep + k, sizeof deep - (size_t)k, "}");
    EXPECT_ERR(mdt_config_load(write_file("deep.json", deep, (size_t)k), &j), MDT_E_FORMAT,
               "deep.json: JSON nested more than 1000 levels deep (at line 1, column 1006)");
    const char *empty = "";
    EXPECT_ERR(mdt_config_load(write_file("empty.json", empty, 0), &j), MDT_E_FORMAT,
               "invalid JSON near line 1, column 1 (byte 0)");
    /* a safetensors header: bytes count from the start of the file (8-byte length first) */
    const char *hdr = "{\"w\":{\"dtype\":\"F32\",\"shape\":[1] \"data_offsets\":[0,4]}}";
    char file[128] = {0};
    size_t hl = strlen(hdr);
    file[0] = (char)hl;
    memcpy(file + 8, hdr, hl + 1); /* the NUL lands in the (zero) data section */
    mdt_st_file *f = NULL;
    EXPECT_ERR(mdt_st_open(write_file("h.safetensors", file, 8 + hl + 4), &f), MDT_E_FORMAT,
               "header is not valid JSON near line 1, column 33 (byte 40)");
    /* the index */
    char d[128];
    snprintf(d, sizeof d, "%s/ck", g_dir);
    mkdir(d, 0777);
    const char *c = "{\"_class_name\": \"FluxTransformer2DModel\"}";
    write_file("ck/config.json", c, strlen(c));
    const char *idx = "{\"weight_map\": {\n\"a\": \"s1.safetensors\"\n\"b\": 1}}";
    write_file("ck/diffusion_pytorch_model.safetensors.index.json", idx, strlen(idx));
    mdt_ckpt *ck = NULL;
    EXPECT_ERR(mdt_ckpt_open(d, &ck), MDT_E_FORMAT,
               "index.json: invalid JSON near line 3, column 1");
}

static void test_class_name_type(void) {
    const mdt_family *fam;
    const char *cases[][2] = {
        {"{\"_class_name\": 5}", "'_class_name' must be a string, not a number"},
        {"{\"_class_name\": [\"FluxTransformer2DModel\"]}", "must be a string, not an array"},
        {"{\"_class_name\": true}", "must be a string, not true or false"},
        {"{\"num_layers\": 1}", "'_class_name' is missing"},
        {"{\"_class_name\": null}", "'_class_name' is missing"},
        {"{\"_class_name\": \"Unet2D\"}", "model class 'Unet2D' is not supported"},
    };
    for (int i = 0; i < (int)(sizeof cases / sizeof *cases); i++) {
        cJSON *cfg = cJSON_Parse(cases[i][0]);
        mdt_status st = mdt_family_from_config(cfg, &fam);
        EXPECT(st != MDT_OK && strstr(mdt_last_error(), cases[i][1]), "%s -> '%s' (wanted '%s')",
               cases[i][0], mdt_last_error(), cases[i][1]);
        cJSON_Delete(cfg);
    }
}

/* A message longer than the buffer keeps its start and its cause (the end), cut in the middle;
 * a prefix added later does not push the cause out either. A line to print escapes control
 * bytes but keeps what was escaped already. */
static void test_long_messages(void) {
    char path[3100];
    memset(path, 'a', sizeof path - 1);
    path[sizeof path - 1] = 0;
    EXPECT(MDT_FAIL(MDT_E_IO, "%s: no such file (the cause)", path) == MDT_E_IO, "status");
    const char *m = mdt_last_error();
    EXPECT(strncmp(m, "aaaa", 4) == 0 && strstr(m, " ... ") &&
               strcmp(m + strlen(m) - 21, "no such file (the cause)" + 3) == 0 && strlen(m) < 2048,
           "long message: %zu bytes, ends '%s'", strlen(m),
           m + (strlen(m) > 40 ? strlen(m) - 40 : 0));
    mdt_fail_prefix(MDT_E_IO, "step 3 of 4");
    m = mdt_last_error();
    EXPECT(strncmp(m, "step 3 of 4: aaa", 16) == 0 && strstr(m, "(the cause)"),
           "prefixed long message lost its cause");
    char out[64];
    EXPECT(strcmp(mdt_escape_line("a\\x0a\nb\x1b", out, sizeof out), "a\\x0a\\x0ab\\x1b") == 0,
           "escape_line: '%s'", out);
}

static void test_input_dtypes(void) {
    mdt_tensor_set *in = NULL;
    mdt_tensor *t;
    mdt_arena a;
    float *out;
    mdt_arena_init(&a);
    EXPECT_OK(mdt_tensor_set_create(&in));
    /* every number dtype is read as its values (docs/models.md: a timestep, ids or a mask of
     * any integer dtype); BOOL is not a number */
    const mdt_dtype ints[] = {MDT_I16, MDT_I8, MDT_U8, MDT_I32};
    const char *names[] = {"timestep", "hidden_states", "guidance", "ok"};
    for (int i = 0; i < 4; i++) {
        EXPECT_OK(mdt_tensor_set_add(in, names[i], ints[i], 1, (int64_t[]){2}, &t));
        if (t && ints[i] == MDT_I16)
            ((int16_t *)t->data)[0] = -300, ((int16_t *)t->data)[1] = 7;
        if (t && ints[i] == MDT_I8)
            ((int8_t *)t->data)[0] = -100, ((int8_t *)t->data)[1] = 7;
        if (t && ints[i] == MDT_U8)
            ((uint8_t *)t->data)[0] = 200, ((uint8_t *)t->data)[1] = 7;
        if (t && ints[i] == MDT_I32)
            ((int32_t *)t->data)[0] = -70000, ((int32_t *)t->data)[1] = 7;
        const float want0[] = {-300, -100, 200, -70000};
        out = NULL;
        EXPECT_OK(mdt_input_f32(in, names[i], 1, (int64_t[]){2}, &a, &out));
        EXPECT(out && out[0] == want0[i] && out[1] == 7.0f, "%s: read %g, %g",
               mdt_dtype_name(ints[i]), out ? out[0] : 0.0, out ? out[1] : 0.0);
    }
    /* a tensor of another rank: the expected sizes may come from the tensor itself (B and S of
     * a [B, S, C] read from it), so only the rank is named */
    EXPECT_OK(mdt_tensor_set_add(in, "x2", MDT_F32, 2, (int64_t[]){16, 4}, &t));
    EXPECT_ERR(mdt_input_f32(in, "x2", 3, (int64_t[]){16, 4, 4}, &a, &out), MDT_E_INVALID,
               "inputs: tensor 'x2' has shape [16, 4] (2 dims), expected 3 dims");
    EXPECT_OK(mdt_tensor_set_add(in, "flag", MDT_BOOL, 1, (int64_t[]){2}, &t));
    EXPECT_ERR(mdt_input_f32(in, "flag", 1, (int64_t[]){2}, &a, &out), MDT_E_INVALID,
               "inputs: tensor 'flag' has dtype BOOL, expected a number");
    mdt_arena_release(&a);
    mdt_tensor_set_free(in);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/mdt_test_messages_XXXXXX");
    if (!mkdtemp(g_dir))
        return 1;
    test_json_positions();
    test_long_messages();
    test_class_name_type();
    test_input_dtypes();
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", g_dir);
    TEST_END();
}
