/* replay.c — a main for the fuzz targets without libFuzzer: feeds every file named on the command
 * line (seed corpus and saved crash inputs) to LLVMFuzzerTestOneInput once, so that `make test`
 * replays them under the ordinary (or sanitizer) build. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int main(int argc, char **argv) {
    int n = 0;
    for (int i = 1; i < argc; i++) {
        FILE *fp = fopen(argv[i], "rb");
        if (!fp) {
            fprintf(stderr, "replay: cannot open %s\n", argv[i]);
            return 1;
        }
        fseek(fp, 0, SEEK_END);
        long len = ftell(fp);
        rewind(fp);
        uint8_t *buf = malloc((size_t)len + 1);
        size_t got = fread(buf, 1, (size_t)len, fp);
        fclose(fp);
        LLVMFuzzerTestOneInput(buf, got);
        free(buf);
        n++;
    }
    printf("replay: %d passed, 0 failed\n", n);
    return 0;
}
