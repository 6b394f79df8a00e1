/*
 * test_escape.c — mdt_escape, the rendering of strings taken from files (tensor and shard names,
 * dtypes, metadata) in one-line messages: nothing a terminal acts on gets through, well-formed
 * UTF-8 does, and a long name is cut at a character boundary with "...".
 */
#include "core/core.h"
#include "harness.h"

static void expect_esc(const char *in, size_t n, const char *want) {
    char buf[512];
    const char *got = mdt_escape(in, buf, n);
    EXPECT(got == buf && strcmp(buf, want) == 0, "escape to %zu bytes: got '%s', wanted '%s'", n,
           buf, want);
}

int main(void) {
    expect_esc("x_embedder.weight", 64, "x_embedder.weight");
    expect_esc("", 64, "");
    expect_esc(NULL, 64, "(null)");
    /* a newline would forge a second "meshdit: error:" line; ESC [ starts a terminal command */
    expect_esc("a\nmeshdit: error: forged", 64, "a\\x0ameshdit: error: forged");
    expect_esc("\x1b[31mred", 64, "\\x1b[31mred");
    expect_esc("tab\there\r\x7f", 64, "tab\\x09here\\x0d\\x7f");
    /* backslash itself, so that "\x0a" in the output always means the byte */
    expect_esc("a\\x0ab", 64, "a\\x5cx0ab");
    /* well-formed UTF-8 passes; broken, overlong and surrogate forms are escaped byte by byte */
    expect_esc("caf\xc3\xa9 \xe6\x97\xa5 \xf0\x9f\x99\x82", 64,
               "caf\xc3\xa9 \xe6\x97\xa5 \xf0\x9f\x99\x82");
    expect_esc("\xc3", 64, "\\xc3");
    expect_esc("\xc3x", 64, "\\xc3x");
    expect_esc("\xff\xfe", 64, "\\xff\\xfe");
    expect_esc("\xc0\xaf", 64, "\\xc0\\xaf");          /* overlong '/' */
    expect_esc("\xed\xa0\x80", 64, "\\xed\\xa0\\x80"); /* a UTF-16 surrogate */
    expect_esc("\xf4\x90\x80\x80", 64, "\\xf4\\x90\\x80\\x80");
    /* code points terminals act on: C1 CSI (U+009B), line separator, right-to-left override */
    expect_esc("\xc2\x9b"
               "31m",
               64, "\\xc2\\x9b31m");
    expect_esc("a\xe2\x80\xa8"
               "b",
               64, "a\\xe2\\x80\\xa8b");
    expect_esc("\xe2\x80\xae"
               "cod",
               64, "\\xe2\\x80\\xaecod");
    /* cut at a character boundary, "..." added, always NUL-terminated inside n */
    expect_esc("abcdefghij", 11, "abcdefghij");
    expect_esc("abcdefghijk", 11, "abcdefg...");
    expect_esc("abcdef\nxyz", 12, "abcdef...");
    expect_esc("abcdefgh\xc3\xa9xyz", 12, "abcdefgh...");
    char big[1000];
    memset(big, '\n', sizeof big - 1);
    big[sizeof big - 1] = 0;
    char out[MDT_ESC_NAME];
    mdt_escape(big, out, sizeof out);
    EXPECT(strlen(out) < sizeof out && strcmp(out + strlen(out) - 3, "...") == 0 &&
               !strchr(out, '\n'),
           "a long name of newlines is cut: %zu bytes", strlen(out));
    TEST_END();
}
