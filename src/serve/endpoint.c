/*
 * endpoint.c — which endpoints the server binds (meshdit.h: mdt_serve_endpoint_check): ipc
 * socket paths (not too long, not another file, not a live server's socket) and tcp hosts
 * (loopback unless the caller allows more); and the binding itself (mdt_serve_endpoint_bind),
 * done before the weights are read, so a busy port or a missing directory costs no load.
 *
 * Two servers started at once on one ipc path: each checks that no live server listens there,
 * then replaces a stale file and binds. Unlocked, both checks could pass before either bound, the
 * second bind replacing the first's file (2 of 10 tries printed "serving on" twice, one server
 * unreachable). The check and the bind therefore run under flock(LOCK_EX) on the socket's
 * directory — the same lock a client takes before it removes a stale socket file
 * (python/meshdit/client.py) — so the second server finds the first one listening.
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* inet_aton */
#include "serve/serve.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
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
    if (strcasecmp(host, "localhost") == 0) /* names are case-blind */
        return 1;
    memcpy(h, host, n + 1);
    if (h[0] == '[' && h[n - 1] == ']')
        h[n - 1] = 0, memmove(h, h + 1, n - 1);
    struct in_addr a4;
    struct in6_addr a6;
    /* inet_aton, as the resolver reads an IPv4 host: also 127.1 and 0x7f.1 */
    if (inet_aton(h, &a4) == 1)
        return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, h, &a6) == 1) /* ::1, or ::ffff:127.x.y.z */
        return IN6_IS_ADDR_LOOPBACK(&a6) || (IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr[12] == 127);
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
    if (listen_any && host_is_loopback(host))
        return MDT_FAIL(MDT_E_INVALID,
                        "endpoint %s: --listen-any allows a host beyond this machine; this one "
                        "is loopback, where it has no effect (drop it)",
                        shown);
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
        return MDT_OK;                               /* the default ipc endpoint */
    if (strncmp(ep, "ipc://", 6) == 0 && listen_any) /* an option with no effect is refused */
        return MDT_FAIL(MDT_E_INVALID,
                        "endpoint %s: --listen-any allows a tcp host beyond this machine; an ipc "
                        "endpoint is a local socket file, where it has no effect (drop it)",
                        mdt_escape(ep, shown, sizeof shown));
    if (strncmp(ep, "ipc://", 6) == 0)
        return ipc_check(ep + 6);
    if (strncmp(ep, "tcp://", 6) == 0)
        return tcp_check(ep, ep + 6, listen_any);
    return MDT_FAIL(MDT_E_INVALID, "endpoint '%s': must be ipc://PATH or tcp://HOST:PORT",
                    mdt_escape(ep, shown, sizeof shown));
}

/* ---- binding ---- */

/* The directory part of `path` ("." for a bare name). */
static void dir_of(const char *path, char *dir, size_t cap) {
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(dir, cap, ".");
    else if (slash == path)
        snprintf(dir, cap, "/");
    else
        snprintf(dir, cap, "%.*s", (int)(slash - path), path);
}

static mdt_status ipc_bind(const char *path, int *fd, char *bound, size_t bound_cap, char *ipc_path,
                           size_t path_cap) {
    char shown[MDT_ESC_NAME], dir[128], dshown[MDT_ESC_NAME];
    mdt_escape(path, shown, sizeof shown);
    dir_of(path, dir, sizeof dir);
    const int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0)
        return MDT_FAIL(MDT_E_IO, "endpoint ipc://%s: the directory '%s' %s", shown,
                        mdt_escape(dir, dshown, sizeof dshown),
                        errno == ENOENT ? "does not exist" : strerror(errno));
    while (flock(dfd, LOCK_EX) != 0 && errno == EINTR)
        ;
    mdt_status st = ipc_check(path); /* under the lock: no other server binds meanwhile */
    struct stat sb;
    if (st == MDT_OK && lstat(path, &sb) == 0 && S_ISSOCK(sb.st_mode) && unlink(path) != 0)
        st = MDT_FAIL(MDT_E_IO, "endpoint ipc://%s: cannot replace the stale socket file: %s",
                      shown, strerror(errno));
    int s = -1;
    if (st == MDT_OK && (s = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)) < 0)
        st = MDT_FAIL(MDT_E_IO, "endpoint ipc://%s: socket(): %s", shown, strerror(errno));
    if (st == MDT_OK) {
        struct sockaddr_un a;
        memset(&a, 0, sizeof a);
        a.sun_family = AF_UNIX;
        memcpy(a.sun_path, path, strlen(path) + 1);
        const mode_t old = umask(077); /* the socket file is created owner-only */
        const int rc = bind(s, (const struct sockaddr *)&a, sizeof a);
        const int err = errno;
        umask(old);
        if (rc != 0) {
            st = MDT_FAIL(MDT_E_IO, "endpoint ipc://%s: cannot bind: %s", shown, strerror(err));
        } else {
            snprintf(ipc_path, path_cap, "%s", path); /* ours now: removed on failure and at exit */
            if (chmod(path, 0600) != 0 || listen(s, 128) != 0)
                st = MDT_FAIL(MDT_E_IO, "endpoint ipc://%s: %s", shown, strerror(errno));
        }
    }
    flock(dfd, LOCK_UN);
    close(dfd);
    if (st != MDT_OK) {
        if (s >= 0)
            close(s);
        if (ipc_path[0])
            unlink(ipc_path), ipc_path[0] = 0;
        return st;
    }
    *fd = s;
    snprintf(bound, bound_cap, "ipc://%s", path);
    return MDT_OK;
}

static mdt_status tcp_bind(const char *ep, int *fd, char *bound, size_t bound_cap) {
    char shown[MDT_ESC_NAME], host[256];
    mdt_escape(ep, shown, sizeof shown);
    const char *hostport = ep + 6, *colon = strrchr(hostport, ':');
    snprintf(host, sizeof host, "%.*s", (int)(colon - hostport), hostport);
    const size_t hn = strlen(host);
    if (hn >= 2 && host[0] == '[' && host[hn - 1] == ']') /* [::1] */
        memmove(host, host + 1, hn - 2), host[hn - 2] = 0;
    const char *port = colon + 1;
    const long pn = strcmp(port, "*") == 0 ? 0 : strtol(port, NULL, 10);
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    socklen_t len = 0;
    struct sockaddr_in *a4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&ss;
    if (strcmp(host, "localhost") == 0 || strcmp(host, "*") == 0) {
        a4->sin_family = AF_INET, len = sizeof *a4;
        a4->sin_addr.s_addr = htonl(host[0] == '*' ? INADDR_ANY : INADDR_LOOPBACK);
    } else if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
        a4->sin_family = AF_INET, len = sizeof *a4;
    } else if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
        a6->sin6_family = AF_INET6, len = sizeof *a6;
    } else { /* a host name (only with --listen-any): its first address */
        struct addrinfo hints, *res = NULL;
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC, hints.ai_socktype = SOCK_STREAM, hints.ai_flags = AI_PASSIVE;
        const int rc = getaddrinfo(host, NULL, &hints, &res);
        if (rc != 0 || !res || res->ai_addrlen > sizeof ss) {
            if (res)
                freeaddrinfo(res);
            return MDT_FAIL(MDT_E_INVALID, "endpoint %s: cannot resolve the host: %s", shown,
                            rc ? gai_strerror(rc) : "no address");
        }
        memcpy(&ss, res->ai_addr, res->ai_addrlen);
        len = res->ai_addrlen;
        freeaddrinfo(res);
    }
    if (ss.ss_family == AF_INET)
        a4->sin_port = htons((uint16_t)pn);
    else
        a6->sin6_port = htons((uint16_t)pn);
    const int s = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s < 0)
        return MDT_FAIL(MDT_E_IO, "endpoint %s: socket(): %s", shown, strerror(errno));
    const int one = 1;
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one); /* a restart after TIME_WAIT */
    if (ss.ss_family == AF_INET6)
        setsockopt(s, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    if (bind(s, (const struct sockaddr *)&ss, len) != 0 || listen(s, 128) != 0) {
        const int err = errno;
        close(s);
        return MDT_FAIL(MDT_E_IO, "endpoint %s: cannot bind: %s", shown, strerror(err));
    }
    len = sizeof ss;
    getsockname(s, (struct sockaddr *)&ss, &len);
    char addr[INET6_ADDRSTRLEN] = "?";
    if (ss.ss_family == AF_INET) {
        inet_ntop(AF_INET, &a4->sin_addr, addr, sizeof addr);
        snprintf(bound, bound_cap, "tcp://%s:%u", addr, (unsigned)ntohs(a4->sin_port));
    } else {
        inet_ntop(AF_INET6, &a6->sin6_addr, addr, sizeof addr);
        snprintf(bound, bound_cap, "tcp://[%s]:%u", addr, (unsigned)ntohs(a6->sin6_port));
    }
    *fd = s;
    return MDT_OK;
}

mdt_status mdt_serve_endpoint_bind(const char *ep, int listen_any, int *fd, char *bound,
                                   size_t bound_cap, char *ipc_path, size_t path_cap) {
    *fd = -1;
    ipc_path[0] = 0;
    MDT_TRY(mdt_serve_endpoint_check(ep, listen_any));
    if (strncmp(ep, "ipc://", 6) == 0)
        return ipc_bind(ep + 6, fd, bound, bound_cap, ipc_path, path_cap);
    return tcp_bind(ep, fd, bound, bound_cap);
}
