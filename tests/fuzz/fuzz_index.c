/* fuzz_index.c — libFuzzer target: the input is a diffusion_pytorch_model.safetensors.index.json
 * in a directory that holds a config.json and two valid shards (s1.safetensors with tensor 'a',
 * s2.safetensors with 'b'). Opening must succeed or fail with a status; shard names must never
 * escape the directory. */
#define _POSIX_C_SOURCE 200809L
#include "io/checkpoint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char g_dir[64];

static void write_file(const char *name, const void *p, size_t n) {
    char path[128];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    FILE *fp = fopen(path, "wb");
    if (!fp)
        return;
    fwrite(p, 1, n, fp);
    fclose(fp);
}

static void setup(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/mdt_fuzz_index_XXXXXX");
    if (!mkdtemp(g_dir))
        abort();
    const char *cfg = "{\"_class_name\": \"FluxTransformer2DModel\"}";
    write_file("config.json", cfg, strlen(cfg));
    const char *h1 = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
    const char *h2 = "{\"b\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4]}}";
    unsigned char buf[256] = {0};
    size_t l1 = strlen(h1), l2 = strlen(h2);
    buf[0] = (unsigned char)l1;
    memcpy(buf + 8, h1, l1 + 1); /* the NUL lands in the (zero) data section */
    write_file("s1.safetensors", buf, 8 + l1 + 8);
    memset(buf, 0, sizeof buf);
    buf[0] = (unsigned char)l2;
    memcpy(buf + 8, h2, l2 + 1);
    write_file("s2.safetensors", buf, 8 + l2 + 4);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_dir[0])
        setup();
    write_file(MDT_CKPT_INDEX, data, size);
    mdt_ckpt *c = NULL;
    if (mdt_ckpt_open(g_dir, &c) == MDT_OK) {
        const mdt_ckpt_ref *r;
        (void)mdt_ckpt_find(c, "a", &r);
        (void)mdt_ckpt_find(c, "b", &r);
        mdt_ckpt_close(c);
    }
    return 0;
}
