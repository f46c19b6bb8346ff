/*
 * toolreg-init: holds a container's tool until its call is released, then runs it and
 * reports its output and exit as frames (protocol v2).
 *
 * The registry creates and starts containers before their calls arrive (warm pools),
 * so the container's command is `toolreg-init PROG [ARG...]` instead of the tool's own:
 * nothing of the tool may run before its call is admitted and approved. Once the tool
 * ends, the init says so at once, so the server answers the call without waiting for
 * the engine to notice the exit.
 *
 * Protocol v2. Everything the init writes on stdout (fd 1) is a frame: one type byte,
 * a 4-byte big-endian payload length, the payload.
 *   'H' hello, payload 1 byte: the protocol version; written first, at start;
 *   'O' / 'E' a piece of the tool's stdout / stderr;
 *   'X' exit, payload 5 bytes: 0 and the exit status, or 1 and the signal that
 *       killed the tool (4 bytes, big-endian); the last frame.
 * stdin (fd 0): one byte first; the go byte 'G' runs PROG, which inherits stdin with
 * the rest of the stream (the call's input, then EOF). EOF, any other byte or a read
 * error: exit 125 without running anything.
 *
 * The tool's stdout and stderr are pipes the init reads, so every byte of the tool
 * travels inside a frame: it cannot forge one. The init is not dumpable, so a tool
 * running as the same user can neither open /proc/1/fd/1 nor ptrace it. Limits stay
 * the server's: it caps output, kills at its deadline and trusts no frame for either.
 *
 * Exit codes of its own: 125 not released (nothing ran), 126 PROG found but not
 * executable (EACCES), 127 PROG could not be run otherwise, as a shell; otherwise the
 * tool's status, or 128 + the signal that killed it.
 *
 * Build: gcc -static -Os -s -Wall -Wextra -Werror (make init).
 */
#define _GNU_SOURCE /* pipe2(2) */

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define PROTOCOL_VERSION 2    /* docker_backend.INIT_PROTOCOL */
#define GO_BYTE 'G'           /* releases the tool (docker_backend.GO_BYTE) */
#define EXIT_NOT_RELEASED 125 /* no go byte: the tool was never run */
#define EXIT_NOT_EXECUTABLE 126
#define EXIT_CANNOT_RUN 127
#define CHUNK 65536            /* bytes per output frame at most */
#define DRAIN_READS 64         /* reads per pipe after the tool ended (a grandchild may go on) */

static int chld_pipe[2] = {-1, -1}; /* SIGCHLD -> poll(2) (the self-pipe trick) */

static void on_sigchld(int sig)
{
    int saved = errno;

    (void)sig;
    if (write(chld_pipe[1], "c", 1) < 0) { /* full: a wake-up is pending anyway */
    }
    errno = saved;
}

static int write_all(int fd, const void *buf, size_t len)
{
    const unsigned char *p = buf;

    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static void put_be32(unsigned char *out, uint32_t value)
{
    out[0] = (unsigned char)(value >> 24);
    out[1] = (unsigned char)(value >> 16);
    out[2] = (unsigned char)(value >> 8);
    out[3] = (unsigned char)value;
}

/* A failed write means the server is gone: nobody is left to tell, so carry on. */
static void send_frame(char type, const void *payload, uint32_t len)
{
    unsigned char header[5];

    header[0] = (unsigned char)type;
    put_be32(header + 1, len);
    if (write_all(STDOUT_FILENO, header, sizeof header) == 0 && len > 0)
        (void)write_all(STDOUT_FILENO, payload, len);
}

static void send_exit(int how, uint32_t value)
{
    unsigned char payload[5];

    payload[0] = (unsigned char)how;
    put_be32(payload + 1, value);
    send_frame('X', payload, sizeof payload);
}

/* One byte with read(2), never stdio: a buffered read would swallow the tool's input. */
static int read_one_byte(void)
{
    unsigned char byte;
    ssize_t n;

    do {
        n = read(STDIN_FILENO, &byte, 1);
    } while (n < 0 && errno == EINTR);
    return n == 1 ? byte : -1; /* -1: EOF or a read error */
}

enum { RELAY_EOF, RELAY_DATA, RELAY_EMPTY };

/* Relay one read of a pipe as one frame. */
static int relay(int fd, char type)
{
    static char buf[CHUNK];
    ssize_t n;

    do {
        n = read(fd, buf, sizeof buf);
    } while (n < 0 && errno == EINTR);
    if (n > 0) {
        send_frame(type, buf, (uint32_t)n);
        return RELAY_DATA;
    }
    if (n < 0 && errno == EAGAIN)
        return RELAY_EMPTY;
    return RELAY_EOF;
}

/* What is already in a pipe, without waiting for a writer that lives on. */
static void drain(int fd, char type)
{
    int i;

    if (fd < 0)
        return;
    (void)fcntl(fd, F_SETFL, O_NONBLOCK);
    for (i = 0; i < DRAIN_READS && relay(fd, type) == RELAY_DATA; i++)
        ;
}

static void run_exec(int errp, char *argv[])
{
    int err;

    execvp(argv[0], argv);
    err = errno;
    if (write_all(errp, &err, sizeof err) < 0) { /* the parent then sees EOF: 127 */
    }
    _exit(EXIT_CANNOT_RUN);
}

int main(int argc, char *argv[])
{
    int out[2], err[2], errp[2], byte, exec_errno = 0, status = 0, done = 0;
    unsigned char version = PROTOCOL_VERSION;
    struct sigaction sa;
    pid_t child;
    ssize_t n;

    /* Not dumpable: the tool (same uid) cannot reach our stdout through /proc or ptrace. */
    (void)prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    send_frame('H', &version, 1);
    if (argc < 2) {
        fputs("toolreg-init: usage: toolreg-init PROG [ARG...]\n", stderr);
        return EXIT_NOT_RELEASED;
    }
    byte = read_one_byte();
    if (byte != GO_BYTE) {
        if (byte >= 0) /* EOF is the normal discard: silent */
            fprintf(stderr, "toolreg-init: protocol v%d: expected the go byte, got 0x%02x\n",
                    PROTOCOL_VERSION, (unsigned)byte);
        return EXIT_NOT_RELEASED;
    }
    if (pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0 || pipe2(errp, O_CLOEXEC) < 0 ||
        pipe2(chld_pipe, O_CLOEXEC | O_NONBLOCK) < 0) {
        perror("toolreg-init: pipe");
        send_exit(0, EXIT_CANNOT_RUN);
        return EXIT_CANNOT_RUN;
    }
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigchld;
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGCHLD, &sa, NULL);

    child = fork();
    if (child < 0) {
        perror("toolreg-init: fork");
        send_exit(0, EXIT_CANNOT_RUN);
        return EXIT_CANNOT_RUN;
    }
    if (child == 0) {
        signal(SIGCHLD, SIG_DFL);
        if (dup2(out[1], STDOUT_FILENO) < 0 || dup2(err[1], STDERR_FILENO) < 0)
            _exit(EXIT_CANNOT_RUN);
        run_exec(errp[1], argv + 1);
    }
    close(out[1]);
    close(err[1]);
    close(errp[1]);
    do { /* EOF: the exec succeeded (close-on-exec); an int: it failed with that errno */
        n = read(errp[0], &exec_errno, sizeof exec_errno);
    } while (n < 0 && errno == EINTR);
    close(errp[0]);
    if (n == (ssize_t)sizeof exec_errno) {
        char msg[512];
        int len = snprintf(msg, sizeof msg, "toolreg-init: cannot run %s: %s\n", argv[1],
                           strerror(exec_errno));
        int code = exec_errno == EACCES ? EXIT_NOT_EXECUTABLE : EXIT_CANNOT_RUN;
        send_frame('E', msg, (uint32_t)(len < (int)sizeof msg ? len : (int)sizeof msg - 1));
        while (waitpid(child, NULL, 0) < 0 && errno == EINTR)
            ;
        send_exit(0, (uint32_t)code);
        return code;
    }

    int fds[2] = {out[0], err[0]};
    const char types[2] = {'O', 'E'};
    while (!done) {
        struct pollfd polled[3];
        int count = 0, i;

        polled[count++] = (struct pollfd){.fd = chld_pipe[0], .events = POLLIN};
        for (i = 0; i < 2; i++)
            polled[count++] = (struct pollfd){.fd = fds[i], .events = POLLIN}; /* -1: ignored */
        if (poll(polled, (nfds_t)count, -1) < 0 && errno != EINTR)
            break;
        for (i = 0; i < 2; i++) {
            if (fds[i] >= 0 && (polled[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) {
                if (relay(fds[i], types[i]) == RELAY_EOF) {
                    close(fds[i]);
                    fds[i] = -1;
                }
            }
        }
        if (polled[0].revents & POLLIN) {
            char sink[64];
            while (read(chld_pipe[0], sink, sizeof sink) > 0)
                ;
        }
        for (;;) { /* as PID 1 we also reap orphans; only the tool's status counts */
            int st;
            pid_t reaped = waitpid(-1, &st, WNOHANG);
            if (reaped <= 0)
                break;
            if (reaped == child) {
                status = st;
                done = 1;
            }
        }
    }
    /* The tool ended: what it wrote before is in the pipes; a grandchild that keeps a
     * pipe open must not delay the answer. */
    drain(fds[0], 'O');
    drain(fds[1], 'E');
    if (WIFSIGNALED(status)) {
        send_exit(1, (uint32_t)WTERMSIG(status));
        return 128 + WTERMSIG(status);
    }
    send_exit(0, (uint32_t)WEXITSTATUS(status));
    return WEXITSTATUS(status);
}
