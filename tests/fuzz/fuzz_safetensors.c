/* fuzz_safetensors.c — libFuzzer target: the input is a whole safetensors file. Every input must
 * either open (and then every tensor reads back and converts) or fail with a status; never
 * crash, leak or read out of bounds. */
#define _GNU_SOURCE
#include "io/safetensors.h"

#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int fd = memfd_create("fuzz.safetensors", MFD_CLOEXEC);
    if (fd < 0)
        return 0;
    if (size && write(fd, data, size) != (ssize_t)size) {
        close(fd);
        return 0;
    }
    mdt_st_file *f = NULL;
    if (mdt_st_open_fd(fd, "fuzz.safetensors", &f) != MDT_OK)
        return 0;
    float buf[256];
    for (int i = 0; i < f->n; i++) {
        const mdt_st_entry *e = &f->entries[i];
        int64_t n = (e->end - e->begin) / (int64_t)mdt_dtype_size(e->dtype);
        if (mdt_dtype_is_float(e->dtype))
            (void)mdt_st_read_f32(f, e, 0, n < 256 ? n : 256, buf);
        (void)mdt_st_find(f, e->name);
    }
    (void)mdt_st_meta(f, "format");
    mdt_st_close(f);
    return 0;
}
