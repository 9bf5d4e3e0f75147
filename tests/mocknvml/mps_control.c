/*
 * gpudra mock nvidia-cuda-mps-control: the MPS control daemon and its client, for testing gpudra's
 * MPS sharing without a GPU. Modelled on NVIDIA's tool (man nvidia-cuda-mps-control, and the MPS
 * documentation's "Tools and Interface Reference"); it starts no MPS server and runs no CUDA.
 *
 * Built STATIC by `make mock-mps-control` (build/mock-nvml/nvidia-cuda-mps-control, like the mock
 * nvidia-smi: CDI may mount it into containers without the host's libc); make_driver_root installs
 * it as <root>/usr/bin/nvidia-cuda-mps-control with the root's inventory appended (mock_inventory.h).
 *
 *   nvidia-cuda-mps-control -d    start the daemon in the background: it double-forks and calls
 *                                 setsid, so it outlives its parent; the parent returns once the
 *                                 daemon listens (0), or 1 when it cannot start (already running
 *                                 on this pipe directory: "An instance of this daemon is already running")
 *   nvidia-cuda-mps-control -f    the daemon in the foreground, its control.log lines also on stderr
 *   nvidia-cuda-mps-control       the client: one command per line of stdin, each sent to the daemon,
 *                                 its reply printed; exit 1 when no daemon answers ("Cannot find MPS
 *                                 control daemon process") or (the mock's choice) a command failed
 *   nvidia-cuda-mps-control --mock-cuda-context <uuid>
 *                                 the mock's own, no NVIDIA tool: a CUDA process opening a context on
 *                                 GPU <uuid>, to show what a claim's limits hold against. As CUDA does,
 *                                 it goes through MPS when a daemon answers on CUDA_MPS_PIPE_DIRECTORY
 *                                 (default /tmp/nvidia-mps), and prints `mps <percentage> <limit>M`,
 *                                 the daemon's defaults for it; otherwise it opens a context of its
 *                                 own, which the GPU's compute mode (the mock NVML's state) decides:
 *                                 EXCLUSIVE_PROCESS while an MPS server holds the GPU, or PROHIBITED:
 *                                 refused, exit 2, "all CUDA-capable devices are busy or unavailable"
 *                                 (cudaErrorDevicesUnavailable); else `direct unlimited` (no MPS limit
 *                                 applies to it). The mock's simplification: a running control daemon
 *                                 holds its GPUs as its MPS server would once its first client came.
 *
 * Environment, as the real tool reads it:
 *   CUDA_MPS_PIPE_DIRECTORY  (default /tmp/nvidia-mps): the daemon's unix socket `control`, its lock
 *                            `control_lock` and `nvidia-cuda-mps-control.pid` (the daemon's PID)
 *   CUDA_MPS_LOG_DIRECTORY   (default /var/log/nvidia-mps): control.log, appended, lines
 *                            `[YYYY-MM-DD HH:MM:SS.mmm Control <pid>] <message>`; the daemon logs
 *                            `Starting control daemon using socket <pipe dir>/control` once it
 *                            accepts commands (what a caller can wait for)
 *   CUDA_VISIBLE_DEVICES     the devices the daemon serves (indexes or UUIDs; indexes are mapped
 *                            to the inventory's UUIDs); logged, and the index space of device arguments
 * Both directories are created when missing; relative paths are made absolute.
 *
 * Commands (what the daemon keeps is lost on quit, as with the real one):
 *   set_default_active_thread_percentage <0-100>    reply: the value, "%.1f"
 *   get_default_active_thread_percentage            reply: the value (default 100.0)
 *   set_default_device_pinned_mem_limit <dev> <N>M  (or <N>G); <dev>: an index among the daemon's
 *                                                   devices, or a UUID of one of them
 *   get_default_device_pinned_mem_limit <dev>       reply: "<N>M" ("0M": none set)
 *   get_server_list                                 reply: empty (the mock starts no server)
 *   quit                                            the daemon removes its socket, lock and PID
 *                                                   file, replies, and exits
 * Others, or bad arguments: an error reply. Each command the daemon runs successfully is one line
 * of the driver root's calls.log, `mps-control <pipe dir> <command> [<arg> ...]`; its start is
 * `mps-control <pipe dir> -d <devices>` (mock_state.h). While it runs, the daemon is registered in
 * <state>/mps/<pid>, lines `pipe <dir>`, `log <dir>`, `devices <devices>` and `serves <uuid>,...`
 * (the devices, indexes mapped to UUIDs; `all` when neither CUDA_VISIBLE_DEVICES nor an inventory
 * says which), so tests can find and kill every daemon of a root
 * (gpudra_dev.localcluster.mockstate.kill_mps_daemons).
 *
 * Wire protocol (the mock's own): one connection per command; the client sends the line, the
 * daemon answers "OK\n" or "ERR\n" followed by the reply text, then closes.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <dirent.h>
#include <time.h>
#include <unistd.h>

#include "mock_inventory.h"
#include "mock_state.h"

#define DEFAULT_PIPE_DIR "/tmp/nvidia-mps"
#define DEFAULT_LOG_DIR "/var/log/nvidia-mps"
#define SOCKET_NAME "control"
#define LOCK_NAME "control_lock"
#define PID_NAME "nvidia-cuda-mps-control.pid"
#define CMD_LEN 1024
#define REPLY_LEN 4096
#define MAX_DEVICES 64
#define DEVICE_LEN 96
#define IO_TIMEOUT_S 5

struct limit {
    char device[DEVICE_LEN];
    unsigned long long mib;
};

static struct {
    char pipe[MOCK_PATH_LEN], log[MOCK_PATH_LEN], state[MOCK_PATH_LEN];
    char socket_path[MOCK_PATH_LEN], lock_path[MOCK_PATH_LEN], pid_path[MOCK_PATH_LEN], registry[MOCK_PATH_LEN];
    char devices[4096]; /* the calls.log word: CUDA_VISIBLE_DEVICES, `all` or `none` */
    int nvisible;      /* -1: not known (no inventory, no CUDA_VISIBLE_DEVICES): any device is accepted */
    char visible[MAX_DEVICES][DEVICE_LEN];
    double thread_percentage;
    int nlimits;
    struct limit limits[MAX_DEVICES];
    int listen_fd, lock_fd, log_fd;
    int foreground; /* -f: control.log's lines go to stderr too */
    int cleaned;
} d = {.listen_fd = -1, .lock_fd = -1, .log_fd = -1, .thread_percentage = 100.0};

static struct mock_inventory inv;
static volatile sig_atomic_t stopping;

/* $name as an absolute directory without trailing slashes (default `fallback`); 0 on success. */
static int directory_from_env(const char *name, const char *fallback, char *out, size_t size) {
    const char *value = getenv(name);
    if (!value || !*value) value = fallback;
    int n;
    if (value[0] == '/') {
        n = snprintf(out, size, "%s", value);
    } else {
        char cwd[MOCK_PATH_LEN];
        if (!getcwd(cwd, sizeof cwd)) return -1;
        n = snprintf(out, size, "%s/%s", cwd, value);
    }
    if (n < 0 || (size_t)n >= size) return -1;
    size_t len = (size_t)n;
    while (len > 1 && out[len - 1] == '/') out[--len] = '\0';
    return 0;
}

static void log_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void log_line(const char *fmt, ...) {
    if (d.log_fd < 0) return;
    char line[2048];
    struct timespec now;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &now);
    localtime_r(&now.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "[%04d-%02d-%02d %02d:%02d:%02d.%03ld Control %ld] ", tm.tm_year + 1900,
                     tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, now.tv_nsec / 1000000L,
                     (long)getpid());
    size_t room = sizeof line - (size_t)n - 1; /* one byte kept for the newline */
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, room, fmt, ap);
    va_end(ap);
    if (m < 0) return;
    size_t len = (size_t)n + ((size_t)m < room ? (size_t)m : room - 1); /* a long message is cut */
    line[len++] = '\n';
    if (write(d.log_fd, line, len) < 0) { /* nothing to do: the log is best effort */ }
    if (d.foreground && write(2, line, len) < 0) { /* nobody reads stderr: fine */ }
}

/* -- devices ---------------------------------------------------------------------------------- */

static void resolve_visible(void) {
    int have_inventory = mock_load_inventory(&inv) == 0;
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    d.nvisible = 0;
    if (!cvd) {
        snprintf(d.devices, sizeof d.devices, "all");
        if (!have_inventory) d.nvisible = -1;
        for (int i = 0; have_inventory && i < inv.ngpus && i < MAX_DEVICES; i++)
            snprintf(d.visible[d.nvisible++], DEVICE_LEN, "%s", inv.gpus[i].uuid);
        return;
    }
    if (!*cvd) {
        snprintf(d.devices, sizeof d.devices, "none");
        return;
    }
    snprintf(d.devices, sizeof d.devices, "%s", cvd);
    char buf[sizeof d.devices];
    snprintf(buf, sizeof buf, "%s", cvd);
    char *save = NULL;
    for (char *entry = strtok_r(buf, ", \t", &save); entry && d.nvisible < MAX_DEVICES;
         entry = strtok_r(NULL, ", \t", &save)) {
        const struct mock_gpu *g = NULL;
        if (have_inventory && strspn(entry, "0123456789") == strlen(entry)) g = mock_find_gpu(&inv, entry);
        snprintf(d.visible[d.nvisible++], DEVICE_LEN, "%s", g ? g->uuid : entry);
    }
}

/* A device argument -> the device it names (index among the visible ones, or a visible UUID). */
static const char *resolve_device(const char *arg) {
    if (d.nvisible < 0) return arg;
    if (*arg && strspn(arg, "0123456789") == strlen(arg)) {
        long index = strtol(arg, NULL, 10);
        return strlen(arg) < 4 && index < d.nvisible ? d.visible[index] : NULL;
    }
    for (int i = 0; i < d.nvisible; i++)
        if (strcmp(d.visible[i], arg) == 0) return d.visible[i];
    return NULL;
}

static struct limit *find_limit(const char *device, int create) {
    for (int i = 0; i < d.nlimits; i++)
        if (strcmp(d.limits[i].device, device) == 0) return &d.limits[i];
    if (!create || d.nlimits >= MAX_DEVICES) return NULL;
    struct limit *l = &d.limits[d.nlimits++];
    snprintf(l->device, sizeof l->device, "%s", device);
    l->mib = 0;
    return l;
}

/* "512M" / "2G" -> MiB; 0 on success. */
static int parse_mem(const char *text, unsigned long long *mib) {
    size_t digits = strspn(text, "0123456789");
    if (digits == 0 || digits > 12 || strlen(text) != digits + 1) return -1;
    unsigned long long n = strtoull(text, NULL, 10);
    if (text[digits] == 'M') *mib = n;
    else if (text[digits] == 'G') *mib = n * 1024ULL;
    else return -1;
    return 0;
}

/* -- commands --------------------------------------------------------------------------------- */

#define MAX_WORDS 4

/* Run one command line; the reply text into `reply`. 0 on success, -1 on an error reply. */
static int run_command(char *line, char *reply, size_t size, int *quit) {
    char *words[MAX_WORDS + 1];
    int n = 0;
    char *save = NULL;
    for (char *w = strtok_r(line, " \t", &save); w; w = strtok_r(NULL, " \t", &save)) {
        if (n > MAX_WORDS) break;
        words[n++] = w;
    }
    reply[0] = '\0';
    if (n == 0 || n > MAX_WORDS) {
        snprintf(reply, size, "Invalid command");
        return -1;
    }
    const char *cmd = words[0];
    if (!strcmp(cmd, "set_default_active_thread_percentage") && n == 2) {
        char *end;
        errno = 0;
        double value = strtod(words[1], &end);
        if (errno || *end || end == words[1] || !(value >= 0.0 && value <= 100.0)) {
            snprintf(reply, size, "Invalid active thread percentage %s (0 to 100)", words[1]);
            return -1;
        }
        d.thread_percentage = value;
        snprintf(reply, size, "%.1f", value);
    } else if (!strcmp(cmd, "get_default_active_thread_percentage") && n == 1) {
        snprintf(reply, size, "%.1f", d.thread_percentage);
    } else if (!strcmp(cmd, "set_default_device_pinned_mem_limit") && n == 3) {
        const char *device = resolve_device(words[1]);
        unsigned long long mib;
        if (!device) {
            snprintf(reply, size, "Invalid device %s", words[1]);
            return -1;
        }
        if (parse_mem(words[2], &mib) != 0) {
            snprintf(reply, size, "Invalid memory limit %s (<N>M or <N>G)", words[2]);
            return -1;
        }
        struct limit *l = find_limit(device, 1);
        if (!l) {
            snprintf(reply, size, "Too many devices");
            return -1;
        }
        l->mib = mib;
    } else if (!strcmp(cmd, "get_default_device_pinned_mem_limit") && n == 2) {
        const char *device = resolve_device(words[1]);
        if (!device) {
            snprintf(reply, size, "Invalid device %s", words[1]);
            return -1;
        }
        struct limit *l = find_limit(device, 0);
        snprintf(reply, size, "%lluM", l ? l->mib : 0ULL);
    } else if (!strcmp(cmd, "get_server_list") && n == 1) {
        /* no servers: the mock runs no CUDA */
    } else if (!strcmp(cmd, "quit") && n == 1) {
        *quit = 1;
    } else {
        snprintf(reply, size, "Invalid command %s (or its arguments)", cmd);
        return -1;
    }
    /* what ran, as one calls.log line: the words joined by single spaces */
    char joined[CMD_LEN];
    size_t len = 0;
    joined[0] = '\0';
    for (int i = 0; i < n && len < sizeof joined; i++)
        len += (size_t)snprintf(joined + len, sizeof joined - len, "%s%s", i ? " " : "", words[i]);
    mock_log_call(d.state, "mps-control %s %s", d.pipe, joined);
    return 0;
}

/* -- the daemon ------------------------------------------------------------------------------- */

static void cleanup(void) {
    if (d.cleaned) return;
    d.cleaned = 1;
    unlink(d.socket_path);
    unlink(d.pid_path);
    unlink(d.registry);
    unlink(d.lock_path);
    log_line("Exit");
}

static int send_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

/* One client connection: one command. Returns 1 when the daemon should exit. */
static int serve(int fd) {
    struct timeval timeout = {.tv_sec = IO_TIMEOUT_S};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    char line[CMD_LEN];
    size_t len = 0;
    int complete = 0;
    while (len < sizeof line - 1) {
        ssize_t n = recv(fd, line + len, sizeof line - 1 - len, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        len += (size_t)n;
        if (memchr(line, '\n', len)) {
            complete = 1;
            break;
        }
    }
    line[len] = '\0';
    char *newline = strchr(line, '\n');
    if (newline) *newline = '\0';
    size_t end = strlen(line);
    if (end && line[end - 1] == '\r') line[end - 1] = '\0';
    log_line("Accepting connection...");
    log_line("NEW UI");
    log_line("Cmd:%s", line);
    char reply[REPLY_LEN];
    int quit = 0, ok;
    if (!complete && len == sizeof line - 1) {
        snprintf(reply, sizeof reply, "Command too long");
        ok = -1;
    } else {
        ok = run_command(line, reply, sizeof reply, &quit);
    }
    if (*reply) log_line("%s", reply);
    log_line("UI closed");
    if (quit) cleanup(); /* before the reply: when the client returns, the endpoint is gone */
    char out[REPLY_LEN + 8];
    int n = snprintf(out, sizeof out, "%s\n%s%s", ok == 0 ? "OK" : "ERR", reply, *reply ? "\n" : "");
    send_all(fd, out, (size_t)n < sizeof out ? (size_t)n : sizeof out - 1);
    return quit;
}

static void on_signal(int sig) {
    (void)sig;
    stopping = 1;
}

static int write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return -1;
    size_t len = strlen(text);
    int ok = write(fd, text, len) == (ssize_t)len;
    return close(fd) == 0 && ok ? 0 : -1;
}

/* Everything up to listening, done before -d forks so that its failures (another daemon on this
 * pipe directory above all) are the caller's exit status; messages go to stderr. 0 on success. */
static int open_endpoint(int foreground) {
    d.foreground = foreground;
    if (directory_from_env("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR, d.pipe, sizeof d.pipe) != 0 ||
        directory_from_env("CUDA_MPS_LOG_DIRECTORY", DEFAULT_LOG_DIR, d.log, sizeof d.log) != 0) {
        fprintf(stderr, "nvidia-cuda-mps-control: the pipe or log directory path is too long\n");
        return 1;
    }
    if (mock_tool_state_dir(d.state, sizeof d.state) != 0 ||
        snprintf(d.socket_path, sizeof d.socket_path, "%s/%s", d.pipe, SOCKET_NAME) >= (int)sizeof d.socket_path ||
        snprintf(d.lock_path, sizeof d.lock_path, "%s/%s", d.pipe, LOCK_NAME) >= (int)sizeof d.lock_path ||
        snprintf(d.pid_path, sizeof d.pid_path, "%s/%s", d.pipe, PID_NAME) >= (int)sizeof d.pid_path ||
        snprintf(d.registry, sizeof d.registry, "%s/mps/%d", d.state, 1 << 30) >= (int)sizeof d.registry) {
        fprintf(stderr, "nvidia-cuda-mps-control: path too long\n");
        return 1;
    }
    if (mock_mkdirs(d.pipe, 0755) != 0 || mock_mkdirs(d.log, 0755) != 0) {
        fprintf(stderr, "nvidia-cuda-mps-control: cannot create %s or %s: %s\n", d.pipe, d.log, strerror(errno));
        return 1;
    }
    d.lock_fd = open(d.lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (d.lock_fd < 0) {
        fprintf(stderr, "nvidia-cuda-mps-control: cannot open %s: %s\n", d.lock_path, strerror(errno));
        return 1;
    }
    if (flock(d.lock_fd, LOCK_EX | LOCK_NB) != 0) {
        fprintf(stderr, "An instance of this daemon is already running\n");
        return 1;
    }
    char log_path[MOCK_PATH_LEN + 16];
    snprintf(log_path, sizeof log_path, "%s/control.log", d.log);
    d.log_fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (d.log_fd < 0) {
        fprintf(stderr, "nvidia-cuda-mps-control: cannot open %s: %s\n", log_path, strerror(errno));
        return 1;
    }
    resolve_visible();

    /* The socket: bound by its name relative to the pipe directory, so its length is no limit. */
    unlink(d.socket_path); /* a dead daemon's: we hold the lock */
    d.listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", SOCKET_NAME);
    if (d.listen_fd < 0 || chdir(d.pipe) != 0 || bind(d.listen_fd, (struct sockaddr *)&addr, sizeof addr) != 0 ||
        listen(d.listen_fd, 16) != 0) {
        fprintf(stderr, "nvidia-cuda-mps-control: cannot listen on %s: %s\n", d.socket_path, strerror(errno));
        return 1;
    }
    if (chdir("/") != 0) return 1;
    return 0;
}

/* In the daemon process: its PID file, registry entry, calls.log line and startup lines. */
static int announce(void) {
    char text[MOCK_PATH_LEN * 2 + MAX_DEVICES * DEVICE_LEN + 600];
    snprintf(text, sizeof text, "%ld\n", (long)getpid());
    if (write_file(d.pid_path, text) != 0) {
        fprintf(stderr, "nvidia-cuda-mps-control: cannot write %s: %s\n", d.pid_path, strerror(errno));
        cleanup();
        return 1;
    }
    /* The registry entry is best effort: a state directory it cannot write only loses the record. */
    char serves[MAX_DEVICES * DEVICE_LEN] = "";
    size_t used = 0;
    for (int i = 0; i < d.nvisible && used < sizeof serves; i++)
        used += (size_t)snprintf(serves + used, sizeof serves - used, "%s%s", i ? "," : "", d.visible[i]);
    snprintf(text, sizeof text, "pipe %s\nlog %s\ndevices %s\nserves %s\n", d.pipe, d.log, d.devices,
             d.nvisible < 0 ? "all" : d.nvisible == 0 ? "none" : serves);
    char registry_dir[MOCK_PATH_LEN + 8];
    snprintf(registry_dir, sizeof registry_dir, "%s/mps", d.state);
    if (snprintf(d.registry, sizeof d.registry, "%s/%ld", registry_dir, (long)getpid()) >= (int)sizeof d.registry ||
        mock_mkdirs(registry_dir, 0755) != 0 || write_file(d.registry, text) != 0)
        d.registry[0] = '\0';
    mock_log_call(d.state, "mps-control %s %s %s", d.pipe, d.foreground ? "-f" : "-d", d.devices);
    log_line("CUDA_VISIBLE_DEVICES=%s, serving %s", getenv("CUDA_VISIBLE_DEVICES") ? d.devices : "(unset)",
             d.nvisible < 0 ? "all" : d.nvisible == 0 ? "none" : serves);
    log_line("Starting control daemon using socket %s", d.socket_path);
    log_line("To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY=%s", d.pipe);
    return 0;
}

static int run_daemon(void) {
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    sigset_t blocked, open_mask;
    sigemptyset(&blocked);
    sigaddset(&blocked, SIGTERM);
    sigaddset(&blocked, SIGINT);
    sigprocmask(SIG_BLOCK, &blocked, &open_mask); /* delivered only inside ppoll: no lost wake-up */
    int quit = 0;
    while (!quit && !stopping) {
        struct pollfd p = {.fd = d.listen_fd, .events = POLLIN};
        if (ppoll(&p, 1, NULL, &open_mask) <= 0) continue;
        int fd = accept4(d.listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) continue;
        quit = serve(fd);
        close(fd);
    }
    cleanup();
    close(d.listen_fd);
    close(d.log_fd);
    close(d.lock_fd);
    return 0;
}

/* Close every descriptor the caller left open, except stdio, the daemon's own and `ready`. */
static void close_inherited(int ready) {
    struct rlimit rl;
    long max = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY ? (long)rl.rlim_cur : 1024;
    if (max > 65536) max = 65536;
    for (int fd = 3; fd < max; fd++)
        if (fd != ready && fd != d.listen_fd && fd != d.lock_fd && fd != d.log_fd) close(fd);
}

static int start_background(void) {
    int rc = open_endpoint(0); /* the lock taken here is the daemon's: flock follows the open file */
    if (rc != 0) return rc;
    int ready[2];
    if (pipe2(ready, O_CLOEXEC) != 0) return 1;
    pid_t child = fork();
    if (child < 0) return 1;
    if (child > 0) {
        close(ready[1]);
        waitpid(child, NULL, 0); /* the intermediate exits at once */
        char status = 0;
        ssize_t n;
        do n = read(ready[0], &status, 1);
        while (n < 0 && errno == EINTR);
        close(ready[0]);
        if (n == 1 && status == '0') return 0;
        fprintf(stderr, "nvidia-cuda-mps-control: the daemon did not start\n");
        return 1;
    }
    close(ready[0]);
    setsid();
    pid_t grandchild = fork();
    if (grandchild != 0) _exit(grandchild < 0 ? 1 : 0);
    /* the daemon: no controlling terminal, not a session leader, reparented once the intermediate exits */
    close_inherited(ready[1]);
    umask(022);
    rc = announce();
    if (rc != 0) _exit(rc); /* the parent sees EOF on `ready` */
    int null = open("/dev/null", O_RDWR);
    if (null >= 0) {
        dup2(null, 0);
        dup2(null, 1);
        dup2(null, 2);
        if (null > 2) close(null);
    }
    if (write(ready[1], "0", 1) < 0) { /* parent gone: keep serving */ }
    close(ready[1]);
    _exit(run_daemon());
}

/* -- the client ------------------------------------------------------------------------------- */

/* Send one command; its reply text into `answer` (when not NULL) or printed. 0 ok, 1 an error
 * reply, -1 no daemon. */
static int exchange(const char *command, char *answer, size_t size) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", SOCKET_NAME); /* relative: we are in the pipe dir */
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    char out[CMD_LEN + 2];
    int n = snprintf(out, sizeof out, "%s\n", command);
    if (send_all(fd, out, (size_t)n) != 0) {
        close(fd);
        return -1;
    }
    shutdown(fd, SHUT_WR);
    char reply[REPLY_LEN + 16];
    size_t len = 0;
    for (;;) {
        ssize_t r = recv(fd, reply + len, sizeof reply - 1 - len, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        len += (size_t)r;
        if (len == sizeof reply - 1) break;
    }
    close(fd);
    reply[len] = '\0';
    char *text = strchr(reply, '\n');
    if (!text) return -1; /* the daemon went away without answering */
    *text++ = '\0';
    if (answer) {
        snprintf(answer, size, "%s", text);
        answer[strcspn(answer, "\n")] = '\0';
    } else {
        fputs(text, stdout);
        fflush(stdout);
    }
    return strcmp(reply, "OK") == 0 ? 0 : 1;
}

static int send_command(const char *command) { return exchange(command, NULL, 0); }

static int client(void) {
    char pipe_dir[MOCK_PATH_LEN];
    if (directory_from_env("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR, pipe_dir, sizeof pipe_dir) != 0 ||
        chdir(pipe_dir) != 0) {
        fprintf(stderr, "Cannot find MPS control daemon process\n");
        return 1;
    }
    char line[CMD_LEN];
    int rc = 0;
    while (fgets(line, sizeof line, stdin)) {
        size_t len = strlen(line);
        if (len == sizeof line - 1 && line[len - 1] != '\n') {
            fprintf(stderr, "nvidia-cuda-mps-control: command too long\n");
            int c;
            while ((c = getchar()) != EOF && c != '\n') {}
            rc = 1;
            continue;
        }
        line[strcspn(line, "\r\n")] = '\0';
        if (line[strspn(line, " \t")] == '\0') continue;
        int r = send_command(line);
        if (r < 0) {
            fprintf(stderr, "Cannot find MPS control daemon process\n");
            return 1;
        }
        if (r > 0) rc = 1;
    }
    return rc;
}

/* -- the mock CUDA process -------------------------------------------------------------------- */

/* Whether a running mock control daemon (the registry, <state>/mps/<pid>) serves GPU `uuid`. */
static int held_by_mps_server(const char *state, const char *uuid) {
    char registry[MOCK_PATH_LEN + 8];
    snprintf(registry, sizeof registry, "%s/mps", state);
    DIR *dir = opendir(registry);
    if (!dir) return 0;
    int held = 0;
    for (struct dirent *e; !held && (e = readdir(dir));) {
        if (strspn(e->d_name, "0123456789") != strlen(e->d_name) || !*e->d_name) continue;
        long pid = strtol(e->d_name, NULL, 10);
        if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) continue; /* exited without its cleanup */
        char path[MOCK_PATH_LEN + 40], line[MAX_DEVICES * DEVICE_LEN + 16];
        snprintf(path, sizeof path, "%s/%s", registry, e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        while (!held && fgets(line, sizeof line, f)) {
            if (strncmp(line, "serves ", 7) != 0) continue;
            line[strcspn(line, "\n")] = '\0';
            if (!strcmp(line + 7, "all")) held = 1;
            char *save = NULL;
            for (char *u = strtok_r(line + 7, ",", &save); u && !held; u = strtok_r(NULL, ",", &save))
                held = !strcmp(u, uuid);
        }
        fclose(f);
    }
    closedir(dir);
    return held;
}

static int cuda_context(const char *uuid) {
    char pipe_dir[MOCK_PATH_LEN], state[MOCK_PATH_LEN];
    if (directory_from_env("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR, pipe_dir, sizeof pipe_dir) == 0 &&
        chdir(pipe_dir) == 0) {
        char command[CMD_LEN], percentage[REPLY_LEN] = "", limit[REPLY_LEN] = "";
        snprintf(command, sizeof command, "get_default_device_pinned_mem_limit %s", uuid);
        int rc = exchange("get_default_active_thread_percentage", percentage, sizeof percentage);
        if (rc >= 0) { /* a daemon answers: CUDA goes through MPS */
            if (rc == 0) rc = exchange(command, limit, sizeof limit);
            if (rc != 0) {
                fprintf(stderr, "the MPS daemon refused: %s\n", rc < 0 ? "no answer" : *limit ? limit : percentage);
                return 1;
            }
            printf("mps %s %s\n", percentage, limit);
            return 0;
        }
    }
    if (mock_tool_state_dir(state, sizeof state) != 0) return 1;
    int mode = 0;
    mock_get_value(state, uuid, "compute_mode", 0, &mode);
    if (mode == 2 || (mode == 3 && held_by_mps_server(state, uuid))) {
        printf("busy\n");
        fprintf(stderr, "all CUDA-capable devices are busy or unavailable\n");
        return 2;
    }
    printf("direct unlimited\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 1) return client();
    if (argc == 3 && strcmp(argv[1], "--mock-cuda-context") == 0) return cuda_context(argv[2]);
    if (argc == 2 && strcmp(argv[1], "-d") == 0) return start_background();
    if (argc == 2 && strcmp(argv[1], "-f") == 0) {
        int rc = open_endpoint(1);
        if (rc == 0) rc = announce();
        return rc != 0 ? rc : run_daemon();
    }
    fprintf(stderr, "Usage: nvidia-cuda-mps-control [-d | -f]\n");
    return 1;
}
