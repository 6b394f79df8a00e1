/*
 * loopback_bind.c — a preload library (build/libmeshdit_loopback.so) that keeps a one-host MPI
 * job's sockets on loopback. MPICH's launcher (hydra) binds its PMI port to every interface
 * (INADDR_ANY) whatever -iface or HYDRA_IFACE say, and 16 bytes of garbage sent to that port
 * ended a serve job; preloaded into mpiexec (and through its environment into the proxies and
 * ranks), this rewrites a bind to the wildcard address — 0.0.0.0 or :: — into one to 127.0.0.1
 * or ::1. A bind to a named address is left alone (MPI's own transports are pointed at loopback
 * by their variables: UCX_NET_DEVICES=lo and the like, python/meshdit/server.py). Only for jobs
 * whose ranks all run on this host: a launcher that must be reached from another host cannot
 * listen on loopback. Not part of libmeshdit; nothing else uses it.
 */
#define _POSIX_C_SOURCE 200809L /* not _GNU_SOURCE: glibc then declares bind with a union */
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

#ifndef RTLD_NEXT
#define RTLD_NEXT ((void *)-1L) /* glibc's value; defined only under _GNU_SOURCE */
#endif

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static int (*real)(int, const struct sockaddr *, socklen_t);
    if (!real)
        *(void **)&real = dlsym(RTLD_NEXT, "bind");
    if (!real)
        return -1;
    if (addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr && addr->sa_family == AF_INET6 &&
               len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            a.sin6_addr = in6addr_loopback;
            return real(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real(fd, addr, len);
}
