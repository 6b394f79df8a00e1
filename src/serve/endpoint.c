/*
 * endpoint.c — which endpoints the server binds (meshdit.h: mdt_serve_endpoint_check): ipc
 * socket paths (not too long, not another file, not a live server's socket) and tcp hosts
 * (loopback unless the caller allows more). Checked before the weights are read.
 */
#define _POSIX_C_SOURCE 200809L
#include "serve/serve.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define IPC_PATH_MAX ((int)sizeof(((struct sockaddr_un *)0)->sun_path) - 1)

static mdt_status ipc_check(const char *path) {
    char shown[MDT_ESC_NAME];
    mdt_escape(path, shown, sizeof shown);
    if (!path[0] || strcmp(path, "*") == 0)
        return MDT_FAIL(MDT_E_INVALID, "endpoint ipc://%s: name the socket's path", shown);
    if ((int)strlen(path) > IPC_PATH_MAX)
        return MDT_FAIL(MDT_E_INVALID,
                        "endpoint ipc://%s: the path has %zu bytes, over the %d of a unix socket",
                        shown, strlen(path), IPC_PATH_MAX);
    struct stat sb;
    if (lstat(path, &sb) != 0) {
        if (errno == ENOENT)
            return MDT_OK;
        return MDT_FAIL(MDT_E_INVALID, "endpoint ipc://%s: %s", shown, strerror(errno));
    }
    if (!S_ISSOCK(sb.st_mode))
        return MDT_FAIL(MDT_E_INVALID,
                        "endpoint ipc://%s: the path exists and is not a socket (refusing to "
                        "replace it)",
                        shown);
    /* a socket file: a running server answers a connect; a stale one (a server that died) is
     * replaced by the bind */
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0)
        return MDT_FAIL(MDT_E_INVALID, "endpoint ipc://%s: socket(): %s", shown, strerror(errno));
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    memcpy(a.sun_path, path, strlen(path) + 1);
    const int live = connect(fd, (const struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    if (live)
        return MDT_FAIL(MDT_E_INVALID, "endpoint ipc://%s: a running server listens there", shown);
    return MDT_OK;
}

/* 127.0.0.0/8, ::1 (bracketed or not) or localhost. */
static int host_is_loopback(const char *host) {
    char h[64];
    size_t n = strlen(host);
    if (n == 0 || n >= sizeof h)
        return 0;
    if (strcmp(host, "localhost") == 0)
        return 1;
    memcpy(h, host, n + 1);
    if (h[0] == '[' && h[n - 1] == ']')
        h[n - 1] = 0, memmove(h, h + 1, n - 1);
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, h, &a4) == 1)
        return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, h, &a6) == 1)
        return IN6_IS_ADDR_LOOPBACK(&a6);
    return 0;
}

static mdt_status tcp_check(const char *ep, const char *hostport, int listen_any) {
    char shown[MDT_ESC_NAME], host[256], hshown[MDT_ESC_NAME];
    mdt_escape(ep, shown, sizeof shown);
    const char *colon = strrchr(hostport, ':');
    if (!colon || colon == hostport || (size_t)(colon - hostport) >= sizeof host)
        return MDT_FAIL(MDT_E_INVALID, "endpoint %s: tcp endpoints are tcp://HOST:PORT", shown);
    memcpy(host, hostport, (size_t)(colon - hostport));
    host[colon - hostport] = 0;
    const char *port = colon + 1;
    char *end = NULL;
    const long pn = strtol(port, &end, 10);
    if (strcmp(port, "*") != 0 && (!*port || *end || pn < 1 || pn > 65535))
        return MDT_FAIL(MDT_E_INVALID, "endpoint %s: the port must be 1 to 65535 or *", shown);
    if (!listen_any && !host_is_loopback(host))
        return MDT_FAIL(MDT_E_INVALID,
                        "endpoint %s: '%s' is not a loopback address; the server has no "
                        "authentication, so listening beyond this machine needs --listen-any",
                        shown, mdt_escape(host, hshown, sizeof hshown));
    return MDT_OK;
}

mdt_status mdt_serve_endpoint_check(const char *ep, int listen_any) {
    char shown[MDT_ESC_NAME];
    if (!ep)
        return MDT_OK; /* the default ipc endpoint */
    if (strncmp(ep, "ipc://", 6) == 0)
        return ipc_check(ep + 6);
    if (strncmp(ep, "tcp://", 6) == 0)
        return tcp_check(ep, ep + 6, listen_any);
    return MDT_FAIL(MDT_E_INVALID, "endpoint '%s': must be ipc://PATH or tcp://HOST:PORT",
                    mdt_escape(ep, shown, sizeof shown));
}
