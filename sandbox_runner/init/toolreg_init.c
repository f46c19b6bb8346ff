/*
 * toolreg-init: holds a container's tool until its call is released, then runs it and
 * reports its output and exit as frames (protocol v3).
 *
 * The registry creates and starts containers before their calls arrive (warm pools),
 * so the container's command is `toolreg-init PROG [ARG...]` instead of the tool's own:
 * nothing of the tool may run before its call is admitted and approved. Once the tool
 * ends, the init says so at once, so the server answers the call without waiting for
 * the engine to notice the exit.
 *
 * Protocol v3. Everything the init writes on stdout (fd 1) is a frame: one type byte,
 * a 4-byte big-endian payload length, the payload.
 *   'H' hello, payload 1 byte: the protocol version; written first, at start;
 *   'O' / 'E' a piece of the tool's stdout / stderr;
 *   'X' exit, payload 5 bytes: 0 and the exit status, or 1 and the signal that
 *       killed the tool (4 bytes, big-endian); the last frame. Every other process of
 *       the tool is killed before it, and the init then waits to be removed (at most
 *       LINGER_S), so the engine's work for the container's end comes after the
 *       server's audit write; after SIGKILL (perhaps the memory limit, which the
 *       engine reports only for a stopped container) it exits at once.
 * stdin (fd 0): one byte first, which releases the call or not:
 *   'G' runs PROG, which inherits stdin with the rest of the stream (the call's
 *       input, then EOF);
 *   'S' (v3) runs PROG with a pipe for its stdin; a 4-byte big-endian length and that
 *       many bytes of input follow, which the init writes into the pipe and closes it:
 *       the tool reads its EOF as soon as its input is in, without waiting for the
 *       engine to close the container's stdin (1.8 ms under runc, 2.6 ms under gVisor
 *       here, on a warm call's path);
 *   EOF, any other byte or a read error: exit 125 without running anything.
 *
 * The tool's process is forked while the call is awaited, so that only the execve is
 * left once the go byte comes (a fork costs ~2 ms under gVisor's ptrace platform). Until
 * then that process is still this program: it has its pipes in place and no signal
 * blocked, and blocks reading the go byte from stdin itself; any other byte or EOF,
 * and it exits 125 without exec. SIGPIPE stays blocked in the init (a tool that leaves
 * its input unread must not kill it); the tool starts with no signal blocked or ignored,
 * whatever the init inherited. It tells the init the call was released before it execs,
 * so the init sends no frame but the hello unless the go byte came.
 *
 * The tool's stdout and stderr are pipes the init reads, so every byte of the tool
 * travels inside a frame: it cannot forge one. The init is not dumpable, so a tool
 * running as the same user can neither open /proc/1/fd/1 nor ptrace it. Limits stay
 * the server's: it caps output, kills at its deadline and trusts no frame for either.
 *
 * Prestart (`toolreg-init --prestart PROG [ARG...]`, sandbox_runner/warm_interpreter.py):
 * the held process execs PROG at once instead of at release. PROG is then toolreg's own
 * stand-in for the held process (a Python stub that imports the tool's preloads), never
 * the tool: it gets the report pipe's write end as fd 3 and the sized input pipe's read
 * end as fd 4 (not close-on-exec), reports PRESTART_READY (or PRESTART_FAILED with a
 * message), then blocks on the go byte and reports exactly as held() below does, takes
 * fd 4 as its stdin on 'S', and closes fd 3 (EOF: the tool's code runs now). On
 * PRESTART_READY the init sends an 'R' frame after the hello; on a failure an 'F' frame
 * with the message, and exits 125 (nothing of the tool ran). The server waits for one of
 * them before it counts the container as ready. Everything else is unchanged.
 *
 * Exit codes of its own: 125 not released (nothing ran), 126 PROG found but not
 * executable (EACCES), 127 PROG could not be run otherwise, as a shell; otherwise the
 * tool's status, or 128 + the signal that killed it.
 *
 * Build: gcc -static -Os -s -Wall -Wextra -Werror (make init). -DTOOLREG_INIT_TIMING
 * builds a variant for benchmarks (bench/handoff.py) that also sends the times of the
 * hand-off's steps as an 'E' frame just before the exit frame; never deployed.
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
#include <sys/signalfd.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <time.h>

#define PROTOCOL_VERSION 3    /* docker_backend.INIT_PROTOCOL */
#define GO_BYTE 'G'           /* releases the tool (docker_backend.GO_BYTE) */
#define SIZED_GO_BYTE 'S'     /* releases it with a sized input (docker_backend.SIZED_GO_BYTE) */
#define EXIT_NOT_RELEASED 125 /* no go byte: the tool was never run */
#define EXIT_NOT_EXECUTABLE 126
#define EXIT_CANNOT_RUN 127
#define HEADER 5               /* frame header: type byte + big-endian uint32 length */
#define CHUNK 65536            /* bytes per output frame at most */
#define DRAIN_READS 64         /* reads per pipe after the tool ended (a grandchild may go on) */
#define LINGER_S 10            /* seconds to wait for the server's removal after the exit frame */

/* What the held process tells the init over its report pipe (close-on-exec: EOF after
 * RELEASED means the exec succeeded). */
enum {
    REPORT_RELEASED = 1,
    REPORT_NOT_RELEASED,
    REPORT_EXEC_FAILED,
    REPORT_SETUP_FAILED,
    REPORT_PRESTART_FAILED, /* prestart: value = length of the message that follows */
    REPORT_PRESTART_READY   /* prestart: preloaded, now waiting for the go byte */
};
#define PRESTART_REPORT_FD 3 /* warm_interpreter.py's stub writes its reports here */
#define PRESTART_INPUT_FD 4  /* and takes a sized input from here */
#define PRESTART_MESSAGE 1024 /* bytes of a prestart failure's message at most */

struct report {
    int kind;
    int value;      /* RELEASED, NOT_RELEASED: the byte read (-1: EOF); *_FAILED: errno */
    long long usec; /* timing builds only: when the go byte was read */
};

#ifdef TOOLREG_INIT_TIMING
static long long now_usec(void) /* CLOCK_REALTIME: gVisor's monotonic clock is its own */
{
    struct timespec t;

    if (clock_gettime(CLOCK_REALTIME, &t) < 0)
        return 0;
    return (long long)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}
enum { T_FORK, T_HELD, T_GO, T_FED, T_EXEC, T_OUT1, T_EOF, T_REAPED, T_COUNT };
static long long stamps[T_COUNT];
#define STAMP(i) (stamps[i] = now_usec())
#define STAMP_ONCE(i) (stamps[i] ? 0 : STAMP(i))
#else
#define STAMP(i) ((void)0)
#define STAMP_ONCE(i) ((void)0)
#endif

static unsigned char frame[HEADER + CHUNK]; /* a frame is built here and written at once */
static unsigned char input[CHUNK];          /* a piece of a sized input on its way to the tool */

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

/* The payload (at most CHUNK bytes) is already at frame + HEADER. A failed write means
 * the server is gone: nobody is left to tell, so carry on. */
static void send_built(char type, uint32_t len)
{
    frame[0] = (unsigned char)type;
    put_be32(frame + 1, len);
    (void)write_all(STDOUT_FILENO, frame, HEADER + (size_t)len);
}

static void send_frame(char type, const void *payload, uint32_t len)
{
    if (len > CHUNK)
        len = CHUNK;
    memcpy(frame + HEADER, payload, len);
    send_built(type, len);
}

static void send_exit(int how, uint32_t value)
{
    unsigned char payload[5];

    payload[0] = (unsigned char)how;
    put_be32(payload + 1, value);
#ifdef TOOLREG_INIT_TIMING
    char msg[256];
    int len = snprintf(msg, sizeof msg,
                       "toolreg-init-timing fork=%lld held=%lld go=%lld fed=%lld exec=%lld "
                       "out1=%lld eof=%lld reaped=%lld exit=%lld\n",
                       stamps[T_FORK], stamps[T_HELD], stamps[T_GO], stamps[T_FED],
                       stamps[T_EXEC], stamps[T_OUT1], stamps[T_EOF], stamps[T_REAPED],
                       now_usec());
    if (len > 0 && len < (int)sizeof msg)
        send_frame('E', msg, (uint32_t)len);
#endif
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

/* A whole report, or 0 at EOF (the held process exec'd or died). */
static int read_report(int fd, struct report *rep)
{
    ssize_t n;

    do {
        n = read(fd, rep, sizeof *rep);
    } while (n < 0 && errno == EINTR);
    return n == (ssize_t)sizeof *rep;
}

static void not_released_message(int byte)
{
    if (byte >= 0) /* EOF is the normal discard: silent */
        fprintf(stderr, "toolreg-init: protocol v%d: expected the go byte, got 0x%02x\n",
                PROTOCOL_VERSION, (unsigned)byte);
}

static void wait_for(pid_t child)
{
    while (waitpid(child, NULL, 0) < 0 && errno == EINTR)
        ;
}

/* Only as a container's PID 1 does the init end the tool's other processes and wait to
 * be removed. Run as any other process (a test on the host), kill(-1) would reach every
 * process its user may signal, far beyond the tool: it then exits after the exit frame. */
static int container_init(void)
{
    return getpid() == 1;
}

/* What the tool left running goes now, before the exit frame: the answer still means
 * the tool is gone. (As PID 1, kill(-1) reaches every other process in its namespace.) */
static void end_tool(void)
{
    if (container_init())
        (void)kill(-1, SIGKILL);
}

/* After the exit frame the container stays up until the server removes it, which it
 * does once the call's audit record is durable: stopping now would make the engine
 * write and sync its state files just as the server syncs that record, on the same
 * disk (a warm call's commit took 8.4 ms against 1.0 ms without the engine's writes).
 * LINGER_S bounds it for a server that went away: the reaper removes what is left. */
static void linger(void)
{
    struct timespec left = {LINGER_S, 0};

    if (!container_init())
        return;
    while (waitpid(-1, NULL, 0) > 0 || errno == EINTR) /* what end_tool killed */
        ;
    while (nanosleep(&left, &left) < 0 && errno == EINTR)
        ;
}

/* The tool's process could not be made ready: say so, but only to a released call. */
static int cannot_prepare(const char *prog, int err)
{
    char msg[512];
    int byte = read_one_byte(), len;

    if (byte != GO_BYTE) {
        not_released_message(byte);
        return EXIT_NOT_RELEASED;
    }
    len = snprintf(msg, sizeof msg, "toolreg-init: cannot run %s: %s\n", prog,
                   err ? strerror(err) : "its process died before its call");
    if (len > 0)
        send_frame('E', msg, (uint32_t)(len < (int)sizeof msg ? len : (int)sizeof msg - 1));
    send_exit(0, EXIT_CANNOT_RUN);
    return EXIT_CANNOT_RUN;
}

static void report(int fd, int kind, int value)
{
    struct report rep = {.kind = kind, .value = value, .usec = 0};

#ifdef TOOLREG_INIT_TIMING
    rep.usec = now_usec();
#endif
    if (write_all(fd, &rep, sizeof rep) < 0) { /* the init then sees EOF */
    }
}

/* Every signal back to its default action, whatever the init inherited: an ignored
 * SIGCHLD would leave no child to wait for, and an ignored signal survives exec, so one
 * the engine or a parent left ignored would reach the tool. glibc's sigaction refuses the
 * two it keeps for itself (32 and 33), hence the system call; an all-zero kernel
 * sigaction is SIG_DFL with no flags on every architecture. */
static int default_dispositions(void)
{
    unsigned long dfl[4] = {0};
    int sig;

    for (sig = 1; sig < _NSIG; sig++)
        if (sig != SIGKILL && sig != SIGSTOP &&
            syscall(SYS_rt_sigaction, sig, dfl, NULL, _NSIG / 8) < 0)
            return -1;
    return 0;
}

/* The tool's process until the go byte: nothing here runs any of the tool. `in`: the
 * read end of the pipe a sized input comes through. */
static void held(int in, int out, int err, int rep, char *argv[])
{
    sigset_t none;
    int byte;

    /* The tool starts with no signal blocked, whatever the init blocks or inherited. */
    if (sigemptyset(&none) < 0 || sigprocmask(SIG_SETMASK, &none, NULL) < 0 ||
        dup2(out, STDOUT_FILENO) < 0 || dup2(err, STDERR_FILENO) < 0) {
        report(rep, REPORT_SETUP_FAILED, errno);
        _exit(EXIT_CANNOT_RUN);
    }
    byte = read_one_byte();
    if (byte != GO_BYTE && byte != SIZED_GO_BYTE) {
        report(rep, REPORT_NOT_RELEASED, byte);
        _exit(EXIT_NOT_RELEASED);
    }
    report(rep, REPORT_RELEASED, byte);
    /* Released: a failure from here on is the call's, reported to it in frames. */
    if (byte != SIZED_GO_BYTE || dup2(in, STDIN_FILENO) >= 0)
        execvp(argv[0], argv);
    report(rep, REPORT_EXEC_FAILED, errno);
    _exit(EXIT_CANNOT_RUN);
}

/* Prestart: the held process becomes PROG (the stub) now, with its report pipe and the
 * sized input's pipe at known numbers; the stub does the rest of held() itself. */
static void held_prestart(int in, int out, int err, int rep, char *argv[])
{
    sigset_t none;
    int rep_copy, in_copy;

    /* Copies above the low numbers first: a pipe may itself be fd 3 or 4. dup2 leaves
     * the targets without close-on-exec; every other pipe end closes at exec. */
    if (sigemptyset(&none) < 0 || sigprocmask(SIG_SETMASK, &none, NULL) < 0 ||
        dup2(out, STDOUT_FILENO) < 0 || dup2(err, STDERR_FILENO) < 0 ||
        (rep_copy = fcntl(rep, F_DUPFD_CLOEXEC, 10)) < 0 ||
        (in_copy = fcntl(in, F_DUPFD_CLOEXEC, 10)) < 0 ||
        dup2(rep_copy, PRESTART_REPORT_FD) < 0 || dup2(in_copy, PRESTART_INPUT_FD) < 0) {
        report(rep, REPORT_SETUP_FAILED, errno);
        _exit(EXIT_CANNOT_RUN);
    }
    execvp(argv[0], argv);
    report(PRESTART_REPORT_FD, REPORT_SETUP_FAILED, errno);
    _exit(EXIT_CANNOT_RUN);
}

/* Prestart: the stub's first report. 1 once it is ready ('R' sent); else 0, after an
 * 'F' frame saying why (the server refuses the container; nothing of the tool ran). */
static int prestart_ready(int fd, const char *prog)
{
    char msg[PRESTART_MESSAGE];
    struct report r;
    int len;

    if (!read_report(fd, &r)) {
        len = snprintf(msg, sizeof msg, "prestart: %s ended before it was ready", prog);
    } else if (r.kind == REPORT_PRESTART_READY) {
        send_frame('R', msg, 0);
        return 1;
    } else if (r.kind == REPORT_PRESTART_FAILED) {
        size_t want = r.value > 0 && r.value < (int)sizeof msg ? (size_t)r.value : 0, got = 0;
        while (got < want) {
            ssize_t n = read(fd, msg + got, want - got);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0)
                break;
            got += (size_t)n;
        }
        len = (int)got;
    } else {
        len = snprintf(msg, sizeof msg, "prestart: cannot start %s: %s", prog,
                       r.kind == REPORT_SETUP_FAILED ? strerror(r.value) : "unexpected report");
    }
    if (len < 0)
        len = 0;
    send_frame('F', msg, (uint32_t)(len < (int)sizeof msg ? len : (int)sizeof msg - 1));
    return 0;
}

enum { RELAY_EOF, RELAY_DATA, RELAY_EMPTY };

/* Relay one read of a pipe as one frame, in one write. */
static int relay(int fd, char type)
{
    ssize_t n;

    do {
        n = read(fd, frame + HEADER, CHUNK);
    } while (n < 0 && errno == EINTR);
    if (n > 0) {
        send_built(type, (uint32_t)n);
        STAMP_ONCE(T_OUT1);
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

    if (fd < 0 || fcntl(fd, F_SETFL, O_NONBLOCK) < 0)
        return;
    for (i = 0; i < DRAIN_READS && relay(fd, type) == RELAY_DATA; i++)
        ;
}

/* Reap what has ended (as PID 1 we also reap orphans); 1 once the tool is among them. */
static int reap(pid_t child, int options, int *status)
{
    for (;;) {
        int st;
        pid_t reaped = waitpid(-1, &st, options);
        if (reaped < 0 && errno == EINTR)
            continue;
        if (reaped <= 0)
            return 0;
        if (reaped == child) {
            *status = st;
            STAMP(T_REAPED);
            return 1;
        }
    }
}

/* A sized input on its way from the container's stdin into the tool's pipe. */
struct feed {
    int fd;         /* the pipe's write end (non-blocking); -1 once closed */
    uint32_t left;  /* bytes still to read from stdin */
    size_t have;    /* bytes of `input` read but not yet written, from `off` */
    size_t off;
};

static void feed_close(struct feed *f)
{
    if (f->fd >= 0) {
        close(f->fd);
        STAMP(T_FED);
    }
    f->fd = -1;
    f->left = 0;
    f->have = 0;
}

/* The 4-byte big-endian length after 'S'; a stream cut short counts as what came. */
static uint32_t read_length(void)
{
    unsigned char len[4];
    size_t got = 0;

    while (got < sizeof len) {
        ssize_t n = read(STDIN_FILENO, len + got, sizeof len - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return 0;
        got += (size_t)n;
    }
    return (uint32_t)len[0] << 24 | (uint32_t)len[1] << 16 | (uint32_t)len[2] << 8 | len[3];
}

/* Read once from stdin when nothing is pending (it blocks: call it when stdin is
 * readable, or before there is anything else to do), then write what is pending as far
 * as the pipe takes it. The pipe closes once all is in, or at EOF, or when the tool
 * can take no more (EPIPE: it closed its stdin or ended). */
static void feed_step(struct feed *f, int may_read)
{
    if (f->fd < 0)
        return;
    if (f->have == 0 && f->left > 0 && may_read) {
        ssize_t n;
        do {
            n = read(STDIN_FILENO, input, f->left < CHUNK ? f->left : CHUNK);
        } while (n < 0 && errno == EINTR);
        if (n <= 0) {
            feed_close(f);
            return;
        }
        f->have = (size_t)n;
        f->off = 0;
        f->left -= (uint32_t)n;
    }
    while (f->have > 0) {
        ssize_t n = write(f->fd, input + f->off, f->have);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return; /* the pipe is full: poll says when the tool has read */
        if (n < 0) {
            feed_close(f);
            return;
        }
        f->off += (size_t)n;
        f->have -= (size_t)n;
    }
    if (f->left == 0)
        feed_close(f);
}

int main(int argc, char *argv[])
{
    int in[2], out[2], err[2], rep[2], sfd, status = 0, done = 0;
    struct feed feed = {.fd = -1};
    unsigned char version = PROTOCOL_VERSION;
    sigset_t chld, blocked;
    struct report r;
    pid_t child;
    int prestart = argc > 1 && strcmp(argv[1], "--prestart") == 0;
    char **prog = argv + 1 + prestart; /* the tool's command, or the prestart stub's */

    /* Not dumpable: the tool (same uid) cannot reach our stdout through /proc or ptrace. */
    (void)prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    send_frame('H', &version, 1);
    if (argc < 2 + prestart) {
        fputs("toolreg-init: usage: toolreg-init [--prestart] PROG [ARG...]\n", stderr);
        return EXIT_NOT_RELEASED;
    }
    /* SIGCHLD is read from a signalfd, never handled: no handler to run, no EINTR.
     * SIGPIPE stays pending: a write to a tool that left its input makes EPIPE. */
    if (default_dispositions() < 0 || sigemptyset(&chld) < 0 || sigaddset(&chld, SIGCHLD) < 0 ||
        sigemptyset(&blocked) < 0 || sigaddset(&blocked, SIGCHLD) < 0 ||
        sigaddset(&blocked, SIGPIPE) < 0 || sigprocmask(SIG_BLOCK, &blocked, NULL) < 0)
        return cannot_prepare(prog[0], errno);
    if (pipe2(in, O_CLOEXEC) < 0 || pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0 ||
        pipe2(rep, O_CLOEXEC) < 0 || fcntl(in[1], F_SETFL, O_NONBLOCK) < 0)
        return cannot_prepare(prog[0], errno);
    sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0)
        return cannot_prepare(prog[0], errno);
    STAMP(T_FORK);
    child = fork();
    if (child < 0)
        return cannot_prepare(prog[0], errno);
    if (child == 0) { /* never returns */
        if (prestart)
            held_prestart(in[0], out[1], err[1], rep[1], prog);
        held(in[0], out[1], err[1], rep[1], prog);
    }
    STAMP(T_HELD);
    close(in[0]);
    close(out[1]);
    close(err[1]);
    close(rep[1]);
    if (prestart && !prestart_ready(rep[0], prog[0])) {
        wait_for(child);
        return EXIT_NOT_RELEASED;
    }

    /* The call: the go byte, or nothing ever runs. */
    if (!read_report(rep[0], &r)) {
        wait_for(child);
        return cannot_prepare(prog[0], 0);
    }
    if (r.kind == REPORT_NOT_RELEASED) {
        wait_for(child);
        not_released_message(r.value);
        return EXIT_NOT_RELEASED;
    }
    if (r.kind != REPORT_RELEASED) {
        wait_for(child);
        return cannot_prepare(prog[0], r.value);
    }
#ifdef TOOLREG_INIT_TIMING
    stamps[T_GO] = r.usec;
#endif
    feed.fd = in[1];
    if (r.value == SIZED_GO_BYTE) { /* the input goes in while the tool's exec runs */
        feed.left = read_length();
        feed_step(&feed, 1);
    } else {
        feed_close(&feed); /* 'G': the tool reads the container's stdin itself */
    }
    if (read_report(rep[0], &r)) { /* the exec failed (EOF: it succeeded) */
        char msg[512];
        int len = snprintf(msg, sizeof msg, "toolreg-init: cannot run %s: %s\n", prog[0],
                           strerror(r.value));
        int code = r.value == EACCES ? EXIT_NOT_EXECUTABLE : EXIT_CANNOT_RUN;
        if (len > 0)
            send_frame('E', msg, (uint32_t)(len < (int)sizeof msg ? len : (int)sizeof msg - 1));
        feed_close(&feed);
        wait_for(child);
        send_exit(0, (uint32_t)code);
        return code;
    }
    STAMP(T_EXEC);
    close(rep[0]);

    int fds[2] = {out[0], err[0]};
    const char types[2] = {'O', 'E'};
    while (!done) {
        struct pollfd polled[5];
        int i;

        if (fds[0] < 0 && fds[1] < 0 && feed.fd < 0) {
            /* Both pipes at EOF and the input in: only the tool's exit is left. */
            STAMP(T_EOF);
            done = reap(child, 0, &status);
            break;
        }
        polled[0] = (struct pollfd){.fd = sfd, .events = POLLIN};
        for (i = 0; i < 2; i++)
            polled[i + 1] = (struct pollfd){.fd = fds[i], .events = POLLIN}; /* -1: ignored */
        /* The input: stdin when nothing is pending, else the pipe's room. */
        polled[3] = (struct pollfd){.fd = feed.fd >= 0 && feed.have == 0 ? STDIN_FILENO : -1,
                                    .events = POLLIN};
        polled[4] = (struct pollfd){.fd = feed.have > 0 ? feed.fd : -1, .events = POLLOUT};
        if (poll(polled, 5, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (polled[3].revents || polled[4].revents)
            feed_step(&feed, polled[3].revents != 0);
        for (i = 0; i < 2; i++) {
            if (fds[i] >= 0 && (polled[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) {
                if (relay(fds[i], types[i]) == RELAY_EOF) {
                    close(fds[i]);
                    fds[i] = -1;
                }
            }
        }
        if (polled[0].revents & POLLIN) {
            struct signalfd_siginfo info[8];
            while (read(sfd, info, sizeof info) > 0)
                ;
            done = reap(child, WNOHANG, &status);
        }
    }
    /* The tool ended: what it wrote before is in the pipes; a grandchild that keeps a
     * pipe open must not delay the answer. Input it did not take is dropped. */
    feed_close(&feed);
    drain(fds[0], 'O');
    drain(fds[1], 'E');
    if (!done) { /* poll failed: nothing sure to report but that the tool is gone */
        wait_for(child);
        send_exit(0, EXIT_CANNOT_RUN);
        return EXIT_CANNOT_RUN;
    }
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) {
        /* Perhaps the memory limit: the server asks the engine, which says so only
         * once the container has stopped. So it stops at once. */
        send_exit(1, SIGKILL);
        return 128 + SIGKILL;
    }
    end_tool();
    if (WIFSIGNALED(status))
        send_exit(1, (uint32_t)WTERMSIG(status));
    else
        send_exit(0, (uint32_t)WEXITSTATUS(status));
    linger();
    return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}
