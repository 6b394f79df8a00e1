/*
 * errors.c — the public error setter (meshdit.h: mdt_error_set): a client's callback records
 * its message the way library code does with MDT_FAIL.
 */
#include "core/core.h"

#include <stdarg.h>
#include <stdio.h>

mdt_status mdt_error_set(mdt_status code, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return MDT_FAIL(code, "%s", buf);
}
