/*
 * gpudra mock driver: the state the mocks share between processes, and the call log.
 *
 * The mock libnvidia-ml.so.1, the mock nvidia-smi and the mock nvidia-cuda-mps-control run in
 * different processes (the agent, a tool it starts, a test) but model one machine, so what one of
 * them changes the others must see. That state lives in files under the fake driver root:
 *
 *   <root>/run/gpudra-mock/state/<GPU uuid>/compute_mode   NVML compute mode, decimal (absent: 0, DEFAULT)
 *   <root>/run/gpudra-mock/state/<GPU uuid>/timeslice      nvidia-smi compute-policy time slice 0-3 (absent: 0)
 *   <root>/run/gpudra-mock/state/<GPU uuid>/mig_instances  MIG instances made through NVML (mock_nvml.c)
 *   <root>/run/gpudra-mock/state/<GPU uuid>/resets         GPU resets by nvidia-smi -r so far (absent: 0)
 *   <root>/run/gpudra-mock/state/<GPU uuid>/mig_mode       MIG mode set by nvmlDeviceSetMigMode, <current><pending>
 *                                                          as one number: 11, 10, 1, 0 (absent: the inventory's)
 *   <root>/run/gpudra-mock/mps/<pid>                       one per running mock MPS control daemon
 *   <root>/run/gpudra-mock/calls.log                       one line per mutating call, appended
 *   <root>/run/gpudra-mock/events                          health a test injects (xid, ecc, lost,
 *                                                          action, recover lines; see mock_nvml.c)
 *
 * Each value file holds one decimal number and a newline, replaced atomically (write a temporary
 * file, rename it over). calls.log lines are appended with one write(2) on an O_APPEND descriptor,
 * so lines from concurrent processes never interleave. Line formats (single spaces, no quoting):
 *
 *   nvml SetComputeMode <GPU uuid> <mode>                            nvmlDeviceSetComputeMode succeeded
 *   nvml SetMigMode <GPU uuid> <mode>                                nvmlDeviceSetMigMode succeeded
 *   nvidia-smi -c <GPU uuid> <mode>                                  nvidia-smi -c, per GPU it set
 *   nvidia-smi compute-policy <GPU uuid> --set-timeslice <0-3>       per GPU it set
 *   nvidia-smi -r <GPU uuid>                                         per GPU it reset
 *   mps-control <pipe dir> -d|-f <devices>                           a daemon started (-d or -f);
 *                                                                    <devices>: CUDA_VISIBLE_DEVICES,
 *                                                                    `all` when unset, `none` when empty
 *   mps-control <pipe dir> <command> [<arg> ...]                     each command the daemon ran
 *                                                                    (gets and quit included)
 *
 * Only calls that succeeded are logged; calls refused with an error (an invalid value, an unknown
 * or MIG device, no permission) are not.
 *
 * Where <root> comes from: each mock derives it from its own file. The library uses dladdr (its
 * path minus usr/lib/x86_64-linux-gnu), the tools /proc/self/exe (minus usr/bin). A file that is
 * not in that layout takes its own directory as the root. $GPUDRA_MOCK_STATE_DIR, when set,
 * replaces <root>/run/gpudra-mock (for a driver root mounted read-only, as in the agent's pod).
 *
 * Header-only (static inline) so the shared library and the static tools each compile it in.
 */
#ifndef GPUDRA_MOCK_STATE_H
#define GPUDRA_MOCK_STATE_H

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MOCK_STATE_ENV "GPUDRA_MOCK_STATE_DIR"
#define MOCK_STATE_SUBDIR "/run/gpudra-mock"
#define MOCK_PATH_LEN 4096
#define MOCK_LOG_LINE 8192

/* `file`'s directory, with the trailing `layout` (e.g. "/usr/bin") removed when it ends so;
 * 0, or -1 when it does not fit. */
static inline int mock_root_of(const char *file, const char *layout, char *root, size_t size) {
    const char *slash = strrchr(file, '/');
    size_t len = slash ? (size_t)(slash - file) : 0;
    size_t tail = strlen(layout);
    if (len >= tail && strncmp(file + len - tail, layout, tail) == 0) len -= tail;
    int n = slash ? snprintf(root, size, "%.*s", (int)len, file) : snprintf(root, size, ".");
    return n >= 0 && (size_t)n < size ? 0 : -1;
}

/* $GPUDRA_MOCK_STATE_DIR, else <root>/run/gpudra-mock; 0, or -1 when it does not fit. */
static inline int mock_state_dir(const char *root, char *out, size_t size) {
    const char *env = getenv(MOCK_STATE_ENV);
    int n = env && *env ? snprintf(out, size, "%s", env) : snprintf(out, size, "%s%s", root, MOCK_STATE_SUBDIR);
    return n >= 0 && (size_t)n < size ? 0 : -1;
}

/* mkdir -p; 0 on success, else -1 with errno set. */
static inline int mock_mkdirs(const char *path, mode_t mode) {
    char buf[MOCK_PATH_LEN];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, mode) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(buf, mode) != 0 && errno != EEXIST) return -1;
    return 0;
}

/* A UUID is used as a file name: refuse anything that could leave the state directory. */
static inline int mock_safe_name(const char *name) {
    return *name && strlen(name) < 128 && !strchr(name, '/') && strcmp(name, ".") && strcmp(name, "..");
}

/* <state>/state/<uuid>/<key>, read as a decimal int: 1 read, 0 absent (*value = fallback), -1 error. */
static inline int mock_get_value(const char *state, const char *uuid, const char *key, int fallback, int *value) {
    char path[MOCK_PATH_LEN];
    *value = fallback;
    if (!mock_safe_name(uuid)) return -1;
    if (snprintf(path, sizeof path, "%s/state/%s/%s", state, uuid, key) >= (int)sizeof path) return -1;
    FILE *f = fopen(path, "r");
    if (!f) return errno == ENOENT ? 0 : -1;
    int ok = fscanf(f, "%d", value) == 1;
    fclose(f);
    if (!ok) *value = fallback;
    return ok ? 1 : -1;
}

/* Replace <state>/state/<uuid>/<key> with `value` atomically; 0 on success, else -1 with errno. */
static inline int mock_set_value(const char *state, const char *uuid, const char *key, int value) {
    char dir[MOCK_PATH_LEN], path[MOCK_PATH_LEN], tmp[MOCK_PATH_LEN];
    if (!mock_safe_name(uuid)) {
        errno = EINVAL;
        return -1;
    }
    if (snprintf(dir, sizeof dir, "%s/state/%s", state, uuid) >= (int)sizeof dir ||
        snprintf(path, sizeof path, "%s/%s", dir, key) >= (int)sizeof path ||
        snprintf(tmp, sizeof tmp, "%s/.%s.%ld", dir, key, (long)getpid()) >= (int)sizeof tmp) {
        errno = ENAMETOOLONG;
        return -1;
    }
    if (mock_mkdirs(dir, 0755) != 0) return -1;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return -1;
    char text[32];
    int len = snprintf(text, sizeof text, "%d\n", value);
    int ok = write(fd, text, (size_t)len) == len;
    int saved = errno;
    if (close(fd) != 0 && ok) {
        ok = 0;
        saved = errno;
    }
    if (ok && rename(tmp, path) == 0) return 0;
    if (ok) saved = errno;
    unlink(tmp);
    errno = saved;
    return -1;
}

/* FNV-1a 64 over `text` from `h`. */
static inline unsigned long long mock_fnv1a64(const char *text, unsigned long long h) {
    for (const unsigned char *p = (const unsigned char *)text; *p; p++) {
        h ^= *p;
        h *= 0x100000001b3ULL;
    }
    return h;
}

/* The UUID of a MIG device made through NVML (the rule is documented in mock_nvml.c, "MIG GPU and
 * compute instances"; the Python simulator's fake.mig_uuid is the same): the library's and the
 * tools' one definition. `resets`: the GPU's resets so far (<state>/state/<uuid>/resets). */
static inline void mock_mig_uuid(const char *parent, unsigned int gi, unsigned int ci, int resets, char *out,
                                 size_t size) {
    char text[256], hex[33];
    if (resets > 0) snprintf(text, sizeof text, "%s/%u/%u/%d", parent, gi, ci, resets);
    else snprintf(text, sizeof text, "%s/%u/%u", parent, gi, ci);
    unsigned long long h1 = mock_fnv1a64(text, 0xcbf29ce484222325ULL);
    unsigned long long h2 = mock_fnv1a64("#", mock_fnv1a64(text, h1));
    snprintf(hex, sizeof hex, "%016llx%016llx", h1, h2);
    hex[12] = '5';                                                                /* version 5 */
    hex[16] = "89ab"[(hex[16] >= 'a' ? hex[16] - 'a' + 10 : hex[16] - '0') & 3]; /* variant 10 */
    snprintf(out, size, "MIG-%.8s-%.4s-%.4s-%.4s-%.12s", hex, hex + 8, hex + 12, hex + 16, hex + 20);
}

/* Append one line (printf format, no newline) to <state>/calls.log; 0 on success, else -1. */
__attribute__((format(printf, 2, 3))) static inline int mock_log_call(const char *state, const char *fmt, ...) {
    char path[MOCK_PATH_LEN], line[MOCK_LOG_LINE];
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (len < 0 || len >= (int)sizeof line - 1) return -1; /* never log a truncated line */
    line[len++] = '\n';
    if (snprintf(path, sizeof path, "%s/calls.log", state) >= (int)sizeof path) return -1;
    if (mock_mkdirs(state, 0755) != 0) return -1;
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return -1;
    int ok = write(fd, line, (size_t)len) == len;
    close(fd);
    return ok ? 0 : -1;
}

#endif
