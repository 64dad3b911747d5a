/* libserverguard.so: preloaded by dspark.server.launcher into tritonserver and, through the
 * inherited environment, into its Python backend stubs.
 *
 * The API key reaches the server through an inherited pipe instead of its command line: argv
 * holds KEY_MARKER where the key belongs, and before main() the constructor points those
 * arguments at copies with the key read from the descriptor named by $DSPARK_KEY_FD.
 * /proc/<pid>/cmdline shows the original strings, so it never holds the key.
 *
 * Boost.Interprocess, which the Python backend uses for its IPC regions, fchmod()s every
 * /dev/shm object it creates to 0644, undoing the umask. fchmod() here applies the process's
 * umask to /dev/shm objects, so a server started with umask 077 keeps its regions 0600.
 *
 * With $DSPARK_PARENT_PID set (by the launcher, to its own pid), the process asks the kernel for
 * SIGTERM when its parent dies (PR_SET_PDEATHSIG), so a server whose `dspark serve` was killed
 * drains and exits instead of running on alone; a parent already gone by then (the launcher
 * died between fork and exec) means the same at once. The variable is unset: the stubs are
 * Triton's children and it stops them itself.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#define KEY_FD_ENV "DSPARK_KEY_FD"
#define PARENT_PID_ENV "DSPARK_PARENT_PID"
#define KEY_MARKER "@DSPARK_API_KEY@"
#define KEY_MAX 256
#define SHM_FOLDER "/dev/shm/"

static mode_t process_umask;
static int (*real_fchmod)(int, mode_t);

static void fail(const char *what) {
    fprintf(stderr, "error: dspark server guard: %s\n", what);
    fflush(stderr);
    _exit(2);
}

/* The key from `fd` (read to its end, then closed) into `key`; fails unless it has 16 to
 * KEY_MAX characters from A-Z a-z 0-9 . _ ~ - (what dspark accepts as a key). */
static void read_key(int fd, char key[KEY_MAX + 2]) {
    size_t length = 0;
    for (;;) {
        ssize_t got = read(fd, key + length, KEY_MAX + 1 - length);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            fail("cannot read the API key from $" KEY_FD_ENV);
        if (got == 0 || (length += (size_t)got) > KEY_MAX)
            break;
    }
    close(fd);
    key[length] = '\0';
    if (length < 16 || length > KEY_MAX || strspn(key, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                                       "0123456789._~-") != length)
        fail("the API key from $" KEY_FD_ENV " is not 16 to 256 characters from A-Z a-z 0-9 . _ ~ -");
}

/* `arg` with each KEY_MARKER replaced by `key`, in new memory. */
static char *with_key(const char *arg, const char *key) {
    size_t markers = 0, marker = strlen(KEY_MARKER), key_length = strlen(key);
    for (const char *at = strstr(arg, KEY_MARKER); at; at = strstr(at + marker, KEY_MARKER))
        markers++;
    char *out = malloc(strlen(arg) + markers * key_length + 1);
    if (out == NULL)
        fail("out of memory");
    char *end = out;
    for (const char *at; (at = strstr(arg, KEY_MARKER)) != NULL; arg = at + marker) {
        memcpy(end, arg, (size_t)(at - arg));
        end += at - arg;
        memcpy(end, key, key_length);
        end += key_length;
    }
    strcpy(end, arg);
    return out;
}

/* Runs before main() and before any thread exists, so reading the umask by setting it is safe. */
__attribute__((constructor)) static void guard_start(int argc, char **argv) {
    process_umask = umask(0);
    umask(process_umask);
    real_fchmod = (int (*)(int, mode_t))dlsym(RTLD_NEXT, "fchmod");
    const char *parent_text = getenv(PARENT_PID_ENV);
    if (parent_text != NULL) {
        char *parent_end;
        long parent = strtol(parent_text, &parent_end, 10);
        if (*parent_text == '\0' || *parent_end != '\0' || parent <= 0)
            fail("$" PARENT_PID_ENV " is not a process id");
        if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0)
            fail("cannot ask to be stopped with the parent (prctl PR_SET_PDEATHSIG)");
        unsetenv(PARENT_PID_ENV);
        if ((long)getppid() != parent)  /* it died before the request: nobody would stop us */
            raise(SIGTERM);
    }
    const char *fd_text = getenv(KEY_FD_ENV);
    if (fd_text == NULL) {
        /* Else the server would take the marker, which anyone can read here, for its key. */
        for (int i = 1; i < argc; i++)
            if (strstr(argv[i], KEY_MARKER) != NULL)
                fail("the command line holds " KEY_MARKER " but $" KEY_FD_ENV " names no pipe with the key");
        return;
    }
    char *end;
    long fd = strtol(fd_text, &end, 10);
    if (*fd_text == '\0' || *end != '\0' || fd < 0 || fd > 1 << 20)
        fail("$" KEY_FD_ENV " is not a file descriptor");
    char key[KEY_MAX + 2];
    read_key((int)fd, key);
    unsetenv(KEY_FD_ENV);  /* children (the stubs) neither see nor inherit the descriptor */
    for (int i = 1; i < argc; i++)
        if (strstr(argv[i], KEY_MARKER) != NULL)
            argv[i] = with_key(argv[i], key);
    explicit_bzero(key, sizeof key);
}

static int in_shm_folder(int fd) {
    char link[40], target[sizeof SHM_FOLDER];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t length = readlink(link, target, sizeof target - 1);
    return length == (ssize_t)sizeof target - 1 && memcmp(target, SHM_FOLDER, sizeof target - 1) == 0;
}

int fchmod(int fd, mode_t mode) {
    if (real_fchmod == NULL) {
        errno = ENOSYS;
        return -1;
    }
    return real_fchmod(fd, in_shm_folder(fd) ? mode & ~process_umask : mode);
}
