/*
 * toolreg-init: holds a container's tool until its call is released (protocol v1).
 *
 * The registry creates and starts containers before their calls arrive (warm pools),
 * so the container's command is `toolreg-init PROG [ARG...]` instead of the tool's own:
 * nothing of the tool may run before its call is admitted and approved.
 *
 * Protocol v1 (a later version replaces it with a framed protocol):
 *   - read exactly one byte from stdin (fd 0);
 *   - the go byte 'G': exec PROG, which inherits stdin with the rest of the stream
 *     (the call's input, then EOF) and becomes the container's process;
 *   - EOF, any other byte or a read error: exit 125 without running anything.
 *
 * Exit codes of its own: 125 not released (nothing ran), 126 PROG found but not
 * executable (EACCES), 127 PROG could not be run otherwise (e.g. not found), as a shell.
 * Nothing else: default signal dispositions, the environment passed on as it is.
 *
 * Build: gcc -static -Os -s -Wall -Wextra -Werror (make init).
 */
#define _POSIX_C_SOURCE 200809L /* read(2), execvp(3) under -std=c11 */

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define PROTOCOL_VERSION 1    /* docker_backend.INIT_PROTOCOL */
#define GO_BYTE 'G'           /* releases the tool (protocol v1; docker_backend.GO_BYTE) */
#define EXIT_NOT_RELEASED 125 /* no go byte: the tool was never run */
#define EXIT_NOT_EXECUTABLE 126
#define EXIT_CANNOT_RUN 127

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

int main(int argc, char *argv[])
{
    int byte, err;

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
    execvp(argv[1], argv + 1);
    /* Only reached when the exec failed; keep errno before stdio may change it. */
    err = errno;
    fprintf(stderr, "toolreg-init: cannot run %s: %s\n", argv[1], strerror(err));
    return err == EACCES ? EXIT_NOT_EXECUTABLE : EXIT_CANNOT_RUN;
}
