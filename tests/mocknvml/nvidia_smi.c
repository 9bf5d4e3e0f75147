/*
 * gpudra mock nvidia-smi: what a container given a claim's GPU by CDI runs to see which GPUs it has.
 *
 * Built STATIC by `make mock-nvidia-smi` (build/mock-nvml/nvidia-smi): CDI bind-mounts the driver
 * root's usr/bin/nvidia-smi into containers whose images have no libc of the host (the e2e test's
 * busybox image), so it must need nothing but the kernel. It does not load NVML either.
 *
 * make_driver_root (gpudra_operator/localcluster/driverroot.py) installs it as
 * <root>/usr/bin/nvidia-smi with the root's mock-NVML inventory appended (mock_inventory.h: the
 * trailer, and where it looks without one). So the single bind-mounted file knows the driver
 * version and each GPU's index, minor, name, UUID and PCI bus ID, and the MIG devices' UUIDs.
 *
 * The GPUs it reports are those whose /dev/nvidia<minor> node exists (in the container: the ones
 * CDI injected), in minor order, like `nvidia-smi -L`:
 *
 *   gpudra mock nvidia-smi: driver 570.133.20, GPUs: GPU-aaaa GPU-bbbb
 *   GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa) /dev/nvidia3
 *
 * Under each GPU, its MIG devices as the real `nvidia-smi -L` lists them, by MIG device slot: the
 * inventory's and those made through NVML (the mock library's state file mig_instances, UUIDs by
 * its rule), each when both its capability nodes /dev/nvidia-caps/nvidia-cap<N> exist (the driver's
 * fixed minor layout; in a container: those CDI injected):
 *
 *     MIG 1g.10gb     Device  0: (UUID: MIG-...)
 *
 * ($GPUDRA_MOCK_DEV_DIR, test-only, names another directory than /dev to look in.)
 * Exit status 0 with at least one GPU; 9 (the real tool's "couldn't communicate with the NVIDIA
 * driver") with none or without an inventory. `--version` prints the driver version only.
 *
 * The MIG instances made through NVML, on the host's view (every GPU of the inventory, or -i's), in
 * the real tool's tables (status 6 and "No ... found: Not Found" when there are none; the
 * inventory's own MIG devices are not listed here):
 *
 *   nvidia-smi mig -lgi [-i <id>]     GPU instances: GPU, name, profile ID, instance ID, placement
 *   nvidia-smi mig -lci [-i <id>]     compute instances: GPU, GPU instance ID, name, profile ID,
 *                                     instance ID, placement (its compute slices in the GPU instance)
 *
 * The settings gpudra's GPU sharing makes, on the host's view of the machine (every GPU of the
 * inventory, by NVML index, UUID or PCI bus ID; `-i a,b` for several; no -i: all GPUs):
 *
 *   nvidia-smi [-i <id>] -c <DEFAULT|PROHIBITED|EXCLUSIVE_PROCESS|0|2|3>      compute mode
 *   nvidia-smi compute-policy [-i <id>] --set-timeslice <0|1|2|3>               DEFAULT/SHORT/MEDIUM/LONG
 *   nvidia-smi compute-policy [-i <id>] --get-timeslice                         the mock's read-back:
 *                                                                               `<uuid> <0-3>` per GPU
 *
 * The values live in the driver root's shared state, the same files the mock NVML's
 * nvmlDevice{Get,Set}ComputeMode use, and each GPU set is one line of its calls.log (both:
 * mock_state.h). Exit status as the real tool's documents it: 0 success, 2 an invalid argument,
 * 3 not supported on the device (a MIG device: these are per-GPU settings), 4 no permission (a
 * state directory it cannot write), 6 no such GPU ("No devices were found"), 9 no inventory.
 * It stops at the first GPU that fails, like the real tool ("Terminating early due to previous errors.").
 *
 * A GPU reset, which a test uses to model what a reset or a reload of the kernel module does to MIG:
 *
 *   nvidia-smi -r|--gpu-reset [-i <id>]          every MIG GPU and compute instance of the GPU is gone
 *                                                (the mock NVML's and the Python simulator's state file
 *                                                <state>/state/<uuid>/mig_instances emptied under its
 *                                                lock), MIG mode and the other settings kept; the reset
 *                                                counted in <state>/state/<uuid>/resets, so instances
 *                                                made again get new UUIDs (mock_nvml.c); one
 *                                                `nvidia-smi -r <GPU uuid>` line in calls.log per GPU.
 *
 * Refused, as the real tool refuses a GPU in use, while a mock MPS control daemon runs for it
 * (<state>/mps/<pid> naming the GPU or `all`, the process alive): "In use by another client", status
 * 255, nothing reset. A MIG device given to -i: status 3 (a reset is of the whole GPU).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mock_inventory.h"
#include "mock_state.h"

/* nvidia-smi's documented return values */
#define RC_OK 0
#define RC_INVALID_ARGUMENT 2
#define RC_NOT_SUPPORTED 3
#define RC_NO_PERMISSION 4
#define RC_NOT_FOUND 6
#define RC_DRIVER_NOT_LOADED 9
#define RC_OTHER 255

static struct mock_inventory inv;

static const char *const compute_modes[] = {"DEFAULT", "EXCLUSIVE_THREAD", "PROHIBITED", "EXCLUSIVE_PROCESS"};
static const char *const timeslices[] = {"DEFAULT", "SHORT", "MEDIUM", "LONG"};

static int usage_error(void) {
    fprintf(stderr, "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n");
    return RC_INVALID_ARGUMENT;
}

/* `-x V`, `--long V` or `--long=V` at argv[*i]: the value (advancing *i), else NULL. */
static const char *option(int argc, char **argv, int *i, const char *short_name, const char *long_name,
                          int *missing) {
    const char *arg = argv[*i];
    size_t len = strlen(long_name);
    if (strcmp(arg, short_name) == 0 || strcmp(arg, long_name) == 0) {
        if (*i + 1 >= argc) {
            *missing = 1;
            return NULL;
        }
        return argv[++*i];
    }
    if (strncmp(arg, long_name, len) == 0 && arg[len] == '=') return arg + len + 1;
    return NULL;
}

/* A small non-negative decimal, or -1. */
static int small_number(const char *text) {
    if (!*text || strlen(text) > 3 || strspn(text, "0123456789") != strlen(text)) return -1;
    return atoi(text);
}

/* One -i entry: a GPU, or a MIG device (set *mig), by index, UUID or PCI bus ID. */
static const struct mock_gpu *find_target(const char *id, const struct mock_mig **mig) {
    *mig = NULL;
    const struct mock_gpu *g = mock_find_gpu(&inv, id);
    if (g) return g;
    for (int i = 0; i < inv.ngpus; i++)
        if (*inv.gpus[i].bus_id && strcasecmp(inv.gpus[i].bus_id, id) == 0) return &inv.gpus[i];
    *mig = mock_find_mig(&inv, id);
    return NULL;
}

struct target {
    const struct mock_gpu *gpu; /* NULL: the MIG device `mig` */
    const char *mig;
};

/* The devices `ids` names (NULL: every GPU) into `out`; the exit status on failure, else 0. */
static int select_targets(const char *ids, struct target *out, int *n) {
    *n = 0;
    if (!ids) {
        for (int i = 0; i < inv.ngpus; i++) out[(*n)++] = (struct target){&inv.gpus[i], NULL};
        return RC_OK;
    }
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", ids) >= (int)sizeof buf) return usage_error();
    char *save = NULL;
    for (char *id = strtok_r(buf, ",", &save); id; id = strtok_r(NULL, ",", &save)) {
        const struct mock_mig *mig;
        const struct mock_gpu *g = find_target(id, &mig);
        if (!g && !mig) {
            fprintf(stderr, "No devices were found\n");
            return RC_NOT_FOUND;
        }
        if (*n >= MOCK_MAX_GPUS) return usage_error();
        out[(*n)++] = (struct target){g, g ? NULL : mig->uuid};
    }
    if (*n == 0) return usage_error();
    return RC_OK;
}

/* errno of a failed state write -> the tool's message and status. */
static int state_error(const char *what, const char *bus_id) {
    int denied = errno == EACCES || errno == EPERM || errno == EROFS;
    fprintf(stderr, "Unable to set the %s for GPU %s: %s\nTerminating early due to previous errors.\n", what, bus_id,
            denied ? "Insufficient Permissions" : strerror(errno));
    return denied ? RC_NO_PERMISSION : RC_OTHER;
}

static int not_supported(const char *what, const char *mig) {
    fprintf(stderr, "Unable to set the %s for MIG device %s: Not Supported\n"
                    "Terminating early due to previous errors.\n", what, mig);
    return RC_NOT_SUPPORTED;
}

static int set_compute_mode(const char *ids, const char *value) {
    int mode = small_number(value);
    for (int m = 0; mode < 0 && m < 4; m++)
        if (strcasecmp(value, compute_modes[m]) == 0) mode = m;
    if (mode != 0 && mode != 2 && mode != 3) return usage_error(); /* EXCLUSIVE_THREAD: support removed */
    struct target targets[MOCK_MAX_GPUS];
    int n, rc = select_targets(ids, targets, &n);
    if (rc != RC_OK) return rc;
    char state[MOCK_PATH_LEN];
    if (mock_tool_state_dir(state, sizeof state) != 0) {
        fprintf(stderr, "gpudra mock nvidia-smi: the driver root's path is too long\n");
        return RC_OTHER;
    }
    for (int i = 0; i < n; i++) {
        const struct mock_gpu *g = targets[i].gpu;
        if (!g) return not_supported("compute mode", targets[i].mig);
        if (mock_set_value(state, g->uuid, "compute_mode", mode) != 0) return state_error("compute mode", g->bus_id);
        mock_log_call(state, "nvidia-smi -c %s %d", g->uuid, mode);
        printf("Set compute mode to %s for GPU %s.\n", compute_modes[mode], g->bus_id);
    }
    printf("All done.\n");
    return RC_OK;
}

static int compute_policy(int argc, char **argv) {
    const char *ids = NULL, *set = NULL;
    int get = 0;
    for (int i = 2; i < argc; i++) {
        int missing = 0;
        const char *v;
        if ((v = option(argc, argv, &i, "-i", "--id", &missing))) ids = v;
        else if ((v = option(argc, argv, &i, "--set-timeslice", "--set-timeslice", &missing))) set = v;
        else if (!missing && strcmp(argv[i], "--get-timeslice") == 0) get = 1;
        else return usage_error();
    }
    if (!set == !get) return usage_error(); /* exactly one of them */
    int slice = set ? small_number(set) : 0;
    if (slice < 0 || slice > 3) return usage_error();
    struct target targets[MOCK_MAX_GPUS];
    int n, rc = select_targets(ids, targets, &n);
    if (rc != RC_OK) return rc;
    char state[MOCK_PATH_LEN];
    if (mock_tool_state_dir(state, sizeof state) != 0) {
        fprintf(stderr, "gpudra mock nvidia-smi: the driver root's path is too long\n");
        return RC_OTHER;
    }
    for (int i = 0; i < n; i++) {
        const struct mock_gpu *g = targets[i].gpu;
        if (!g) return not_supported("timeslice", targets[i].mig);
        if (get) {
            int value;
            if (mock_get_value(state, g->uuid, "timeslice", 0, &value) < 0) {
                fprintf(stderr, "Unable to read the timeslice for GPU %s\n", g->bus_id);
                return RC_OTHER;
            }
            printf("%s %d\n", g->uuid, value);
            continue;
        }
        if (mock_set_value(state, g->uuid, "timeslice", slice) != 0) return state_error("timeslice", g->bus_id);
        mock_log_call(state, "nvidia-smi compute-policy %s --set-timeslice %d", g->uuid, slice);
        printf("Set timeslice to %s for GPU %s.\n", timeslices[slice], g->bus_id);
    }
    if (set) printf("All done.\n");
    return RC_OK;
}

/* Whether a running mock MPS control daemon (<state>/mps/<pid>, its `serves` line) holds GPU `uuid`. */
static int in_use(const char *state, const char *uuid) {
    char registry[MOCK_PATH_LEN + 8];
    snprintf(registry, sizeof registry, "%s/mps", state);
    DIR *dir = opendir(registry);
    if (!dir) return 0;
    int held = 0;
    for (struct dirent *e; !held && (e = readdir(dir));) {
        if (!*e->d_name || strspn(e->d_name, "0123456789") != strlen(e->d_name)) continue;
        if (kill((pid_t)strtol(e->d_name, NULL, 10), 0) != 0 && errno == ESRCH) continue; /* exited */
        char path[MOCK_PATH_LEN + 300], line[8192];
        snprintf(path, sizeof path, "%s/%s", registry, e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        while (!held && fgets(line, sizeof line, f)) {
            if (strncmp(line, "serves ", 7) != 0) continue;
            line[strcspn(line, "\n")] = '\0';
            char *save = NULL;
            for (char *u = strtok_r(line + 7, ",", &save); u && !held; u = strtok_r(NULL, ",", &save))
                held = !strcmp(u, "all") || !strcmp(u, uuid);
        }
        fclose(f);
    }
    closedir(dir);
    return held;
}

/* One GPU's reset: under the lock the MIG instance writers take, the reset counted, then the
 * instance file replaced by an empty one; 0, or -1 with errno. */
static int reset_one(const char *state, const char *uuid) {
    char dir[MOCK_PATH_LEN], lock_path[MOCK_PATH_LEN + 32], file[MOCK_PATH_LEN + 32], tmp[MOCK_PATH_LEN + 64];
    if (!mock_safe_name(uuid) || snprintf(dir, sizeof dir, "%s/state/%s", state, uuid) >= (int)sizeof dir) {
        errno = ENAMETOOLONG;
        return -1;
    }
    snprintf(lock_path, sizeof lock_path, "%s/.mig_instances.lock", dir);
    snprintf(file, sizeof file, "%s/mig_instances", dir);
    snprintf(tmp, sizeof tmp, "%s/.mig_instances.%ld.tmp", dir, (long)getpid());
    if (mock_mkdirs(dir, 0755) != 0) return -1;
    int lock = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lock < 0) return -1;
    int rc = -1, resets = 0;
    if (flock(lock, LOCK_EX) == 0 && mock_get_value(state, uuid, "resets", 0, &resets) >= 0 &&
        mock_set_value(state, uuid, "resets", resets + 1) == 0) {
        FILE *f = fopen(tmp, "w");
        if (f) {
            fprintf(f, "# gpudra mock NVML: MIG instances created on %s (reset by nvidia-smi -r)\n", uuid);
            int ok = fclose(f) == 0;
            if (ok && rename(tmp, file) == 0) rc = 0;
            else unlink(tmp);
        }
    }
    int saved = errno;
    close(lock); /* releases the flock */
    errno = saved;
    return rc;
}

static int reset_gpus(const char *ids) {
    struct target targets[MOCK_MAX_GPUS];
    int n, rc = select_targets(ids, targets, &n);
    if (rc != RC_OK) return rc;
    char state[MOCK_PATH_LEN];
    if (mock_tool_state_dir(state, sizeof state) != 0) {
        fprintf(stderr, "gpudra mock nvidia-smi: the driver root's path is too long\n");
        return RC_OTHER;
    }
    for (int i = 0; i < n; i++) {
        if (!targets[i].gpu) {
            fprintf(stderr, "Unable to reset MIG device %s: Not Supported\n", targets[i].mig);
            return RC_NOT_SUPPORTED;
        }
        if (in_use(state, targets[i].gpu->uuid)) {
            fprintf(stderr, "The following GPUs could not be reset:\n  GPU %s: In use by another client\n\n"
                            "1 device is currently being used by one or more other processes. Please first kill "
                            "all processes using this device and all compute applications running in the system.\n",
                    targets[i].gpu->bus_id);
            return RC_OTHER;
        }
    }
    for (int i = 0; i < n; i++) {
        const struct mock_gpu *g = targets[i].gpu;
        if (reset_one(state, g->uuid) != 0) return state_error("reset", g->bus_id);
        mock_log_call(state, "nvidia-smi -r %s", g->uuid);
        printf("GPU %s was successfully reset.\n", g->bus_id);
    }
    printf("All done.\n");
    return RC_OK;
}

/* `-r` anywhere (with an optional -i): a GPU reset; 1 if this is such a call (*rc set). */
static int reset_call(int argc, char **argv, int *rc) {
    const char *ids = NULL;
    int reset = 0, other = 0;
    for (int i = 1; i < argc; i++) {
        int missing = 0;
        const char *v;
        if ((v = option(argc, argv, &i, "-i", "--id", &missing))) ids = v;
        else if (!strcmp(argv[i], "-r") || !strcmp(argv[i], "--gpu-reset")) reset = 1;
        else other = 1;
    }
    if (!reset) return 0;
    *rc = other ? usage_error() : reset_gpus(ids);
    return 1;
}

/* -- MIG instances made through NVML (the mock library's state file) ----------------------------- */

struct created_gi {
    unsigned int gi, profile_id, start, size;
};

struct created_ci {
    unsigned int gi, ci, profile_id, slot;
};

struct created {
    int ngis, ncis, resets;
    struct created_gi gis[16];
    struct created_ci cis[64];
};

/* GPU `g`'s instances from <state>/state/<uuid>/mig_instances (lines the library would skip are
 * skipped: a CI without its GI), and its resets; by ascending IDs, as the file lists them. */
static void read_created(const char *state, const struct mock_gpu *g, struct created *out) {
    char path[MOCK_PATH_LEN + 160], line[256];
    memset(out, 0, sizeof *out);
    if (!mock_safe_name(g->uuid) || mock_get_value(state, g->uuid, "resets", 0, &out->resets) < 0) out->resets = 0;
    snprintf(path, sizeof path, "%s/state/%s/mig_instances", state, g->uuid);
    FILE *f = fopen(path, "r");
    while (f && fgets(line, sizeof line, f)) {
        unsigned int a, b, c, d;
        char kind[4], tail;
        if (sscanf(line, "%3s %u %u %u %u %c", kind, &a, &b, &c, &d, &tail) != 5) continue;
        if (!strcmp(kind, "gi") && out->ngis < 16) {
            out->gis[out->ngis++] = (struct created_gi){a, b, c, d};
        } else if (!strcmp(kind, "ci") && out->ncis < 64) {
            for (int i = 0; i < out->ngis; i++)
                if (out->gis[i].gi == a) {
                    out->cis[out->ncis++] = (struct created_ci){a, b, c, d};
                    break;
                }
        }
    }
    if (f) fclose(f);
}

static const struct created_gi *gi_of(const struct created *c, unsigned int gi) {
    for (int i = 0; i < c->ngis; i++)
        if (c->gis[i].gi == gi) return &c->gis[i];
    return NULL;
}

static const struct mock_gi_profile *profile_by_id(const struct mock_gpu *g, unsigned int id) {
    for (int i = 0; i < g->nprofiles; i++)
        if (g->profiles[i].id == id) return &g->profiles[i];
    return NULL;
}

/* The GPU instance profile name of a MIG device's profile: "1c.3g.20gb" -> "3g.20gb". */
static const char *gi_profile_name(const char *profile) {
    const char *p = profile + strspn(profile, "0123456789");
    return p != profile && p[0] == 'c' && p[1] == '.' ? p + 2 : profile;
}

static const char *dev_dir(void) {
    const char *dir = getenv("GPUDRA_MOCK_DEV_DIR");
    return dir && *dir ? dir : "/dev";
}

/* Whether MIG instance gi/ci of GPU `minor` is visible: both its capability nodes exist (the
 * driver's fixed layout: 15 GPU instances of 9 minors per GPU, from minor 3). */
static int mig_visible(int minor, int gi, int ci) {
    char path[MOCK_PATH_LEN];
    struct stat st;
    int base = 3 + minor * 15 * 9 + gi * 9;
    snprintf(path, sizeof path, "%s/nvidia-caps/nvidia-cap%d", dev_dir(), base);
    if (stat(path, &st) != 0 || !S_ISCHR(st.st_mode)) return 0;
    snprintf(path, sizeof path, "%s/nvidia-caps/nvidia-cap%d", dev_dir(), base + 1 + ci);
    return stat(path, &st) == 0 && S_ISCHR(st.st_mode);
}

struct listed_mig {
    int slot;
    char name[32];
    char uuid[96];
};

/* The visible MIG devices of GPU `g` (the inventory's and the created ones), by slot. */
static int mig_devices_of(const char *state, const struct mock_gpu *g, struct listed_mig *out, int max) {
    int n = 0;
    for (int i = 0; i < inv.nmigs && n < max; i++) {
        const struct mock_mig *m = &inv.migs[i];
        if (m->parent != g->index || !mig_visible(g->minor, m->gi, m->ci)) continue;
        out[n].slot = m->slot;
        snprintf(out[n].name, sizeof out[n].name, "%s", gi_profile_name(m->profile));
        snprintf(out[n].uuid, sizeof out[n].uuid, "%s", m->uuid);
        n++;
    }
    struct created c;
    if (state) read_created(state, g, &c);
    else memset(&c, 0, sizeof c);
    for (int i = 0; i < c.ncis && n < max; i++) {
        const struct created_gi *gi = gi_of(&c, c.cis[i].gi);
        const struct mock_gi_profile *p = gi ? profile_by_id(g, gi->profile_id) : NULL;
        if (!p || !mig_visible(g->minor, (int)c.cis[i].gi, (int)c.cis[i].ci)) continue;
        out[n].slot = (int)c.cis[i].slot;
        snprintf(out[n].name, sizeof out[n].name, "%s", p->name);
        mock_mig_uuid(g->uuid, c.cis[i].gi, c.cis[i].ci, c.resets, out[n].uuid, sizeof out[n].uuid);
        n++;
    }
    for (int i = 1; i < n; i++) /* insertion sort by slot: a handful at most */
        for (int j = i; j > 0 && out[j - 1].slot > out[j].slot; j--) {
            struct listed_mig t = out[j];
            out[j] = out[j - 1];
            out[j - 1] = t;
        }
    return n;
}

static const char *const gi_table_head =
    "+-------------------------------------------------------+\n"
    "| GPU instances:                                        |\n"
    "| GPU   Name             Profile  Instance   Placement  |\n"
    "|                          ID       ID       Start:Size |\n"
    "|=======================================================|\n";
static const char *const gi_table_rule = "+-------------------------------------------------------+\n";
static const char *const ci_table_head =
    "+--------------------------------------------------------------------+\n"
    "| Compute instances:                                                 |\n"
    "| GPU     GPU       Name             Profile   Instance   Placement  |\n"
    "|       Instance                       ID        ID       Start:Size |\n"
    "|         ID                                                         |\n"
    "|====================================================================|\n";
static const char *const ci_table_rule = "+--------------------------------------------------------------------+\n";

/* `nvidia-smi mig -lgi|-lci [-i <id>]`. */
static int mig_listing(int argc, char **argv) {
    const char *ids = NULL;
    int gis = 0, cis = 0;
    for (int i = 2; i < argc; i++) {
        int missing = 0;
        const char *v;
        if ((v = option(argc, argv, &i, "-i", "--id", &missing))) ids = v;
        else if (!missing && (!strcmp(argv[i], "-lgi") || !strcmp(argv[i], "--list-gpu-instances"))) gis = 1;
        else if (!missing && (!strcmp(argv[i], "-lci") || !strcmp(argv[i], "--list-compute-instances"))) cis = 1;
        else return usage_error();
    }
    if (gis == cis) return usage_error(); /* exactly one of them */
    struct target targets[MOCK_MAX_GPUS];
    int n, rc = select_targets(ids, targets, &n);
    if (rc != RC_OK) return rc;
    char state[MOCK_PATH_LEN];
    if (mock_tool_state_dir(state, sizeof state) != 0) {
        fprintf(stderr, "gpudra mock nvidia-smi: the driver root's path is too long\n");
        return RC_OTHER;
    }
    int rows = 0;
    for (int t = 0; t < n; t++) {
        const struct mock_gpu *g = targets[t].gpu;
        if (!g) return not_supported("MIG listing", targets[t].mig);
        struct created c;
        read_created(state, g, &c);
        for (int i = 0; i < (gis ? c.ngis : c.ncis); i++) {
            const struct created_gi *gi = gis ? &c.gis[i] : gi_of(&c, c.cis[i].gi);
            const struct mock_gi_profile *p = gi ? profile_by_id(g, gi->profile_id) : NULL;
            if (!p) continue;
            char name[40];
            snprintf(name, sizeof name, "MIG %s", p->name);
            if (rows++ == 0) fputs(gis ? gi_table_head : ci_table_head, stdout);
            if (gis)
                printf("|%4d  %-20s%2u%9u%11u:%-6u|\n%s", g->index, name, p->id, gi->gi, gi->start, gi->size,
                       gi_table_rule);
            else /* a full-size compute instance: all of its GPU instance's compute slices, from 0 */
                printf("|%4d%7u       %-20s%2u%10u%11u:%-6u|\n%s", g->index, gi->gi, name, c.cis[i].profile_id,
                       c.cis[i].ci, 0u, p->slices, ci_table_rule);
        }
    }
    if (rows == 0) {
        printf("No %s instances found: Not Found\n", gis ? "GPU" : "compute");
        return RC_NOT_FOUND;
    }
    return RC_OK;
}

/* `-c` anywhere (with an optional -i): the compute mode; 1 if this is such a call (*rc set). */
static int compute_mode_call(int argc, char **argv, int *rc) {
    const char *ids = NULL, *mode = NULL;
    int other = 0;
    for (int i = 1; i < argc; i++) {
        int missing = 0;
        const char *v;
        if ((v = option(argc, argv, &i, "-i", "--id", &missing))) ids = v;
        else if ((v = option(argc, argv, &i, "-c", "--compute-mode", &missing))) mode = v;
        else if (missing && (!strcmp(argv[i], "-c") || !strcmp(argv[i], "--compute-mode"))) {
            *rc = usage_error();
            return 1;
        } else other = 1;
    }
    if (!mode) return 0;
    *rc = other ? usage_error() : set_compute_mode(ids, mode);
    return 1;
}

static int present_minors(int *minors, int max) {
    DIR *dev = opendir(dev_dir());
    if (!dev)
        return 0;
    int n = 0;
    struct dirent *entry;
    while ((entry = readdir(dev)) && n < max) {
        const char *digits = entry->d_name + strlen("nvidia");
        if (strncmp(entry->d_name, "nvidia", 6) != 0 || !*digits || strspn(digits, "0123456789") != strlen(digits))
            continue;
        char path[MOCK_PATH_LEN + 300];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dev_dir(), entry->d_name);
        if (stat(path, &st) == 0 && S_ISCHR(st.st_mode))
            minors[n++] = atoi(digits);
    }
    closedir(dev);
    for (int i = 1; i < n; i++)  /* insertion sort: a handful at most */
        for (int j = i; j > 0 && minors[j - 1] > minors[j]; j--) {
            int t = minors[j];
            minors[j] = minors[j - 1];
            minors[j - 1] = t;
        }
    return n;
}

int main(int argc, char **argv) {
    if (mock_load_inventory(&inv) != 0) {
        fprintf(stderr, "gpudra mock nvidia-smi: no inventory (no trailer, no $GPUDRA_MOCK_NVML_INVENTORY, "
                        "no ../lib/x86_64-linux-gnu/gpudra-mock-nvml.inventory)\n");
        return RC_DRIVER_NOT_LOADED;
    }
    if (argc > 1 && strcmp(argv[1], "--version") == 0) {
        printf("gpudra mock nvidia-smi\nDRIVER version : %s\n", inv.driver_version);
        return RC_OK;
    }
    if (argc > 1 && strcmp(argv[1], "compute-policy") == 0) return compute_policy(argc, argv);
    if (argc > 1 && strcmp(argv[1], "mig") == 0) return mig_listing(argc, argv);
    int rc;
    if (reset_call(argc, argv, &rc)) return rc;
    if (compute_mode_call(argc, argv, &rc)) return rc;
    int minors[MOCK_MAX_GPUS];
    int n = present_minors(minors, MOCK_MAX_GPUS);
    const struct mock_gpu *shown[MOCK_MAX_GPUS];
    int nshown = 0;
    for (int i = 0; i < n; i++)
        for (int g = 0; g < inv.ngpus; g++)
            if (inv.gpus[g].minor == minors[i] && nshown < MOCK_MAX_GPUS) shown[nshown++] = &inv.gpus[g];
    printf("gpudra mock nvidia-smi: driver %s, GPUs:", inv.driver_version);
    for (int i = 0; i < nshown; i++)
        printf(" %s", shown[i]->uuid);
    printf("\n");
    char state[MOCK_PATH_LEN];
    int have_state = mock_tool_state_dir(state, sizeof state) == 0;
    for (int i = 0; i < nshown; i++) {
        printf("GPU %d: %s (UUID: %s) /dev/nvidia%d\n", i, shown[i]->name, shown[i]->uuid, shown[i]->minor);
        struct listed_mig migs[32];
        int m = mig_devices_of(have_state ? state : NULL, shown[i], migs, 32);
        for (int k = 0; k < m; k++)
            printf("  MIG %-12sDevice %2d: (UUID: %s)\n", migs[k].name, migs[k].slot, migs[k].uuid);
    }
    if (nshown == 0) {
        fprintf(stderr, "NVIDIA-SMI has failed because it couldn't find a GPU device node (/dev/nvidia<minor>)\n");
        return RC_DRIVER_NOT_LOADED;
    }
    return RC_OK;
}
