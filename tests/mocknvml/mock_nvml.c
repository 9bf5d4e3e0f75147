/*
 * gpudra mock NVML: a libnvidia-ml.so.1 that answers from a plain-text inventory instead of a GPU.
 *
 * Built by `make mock-nvml` (build/mock-nvml/libnvidia-ml.so, soname libnvidia-ml.so.1) and placed in
 * a fake driver root by gpudra_dev.localcluster.fakedriverroot.make_driver_root, so the REAL pynvml
 * (nvidia-ml-py) and NVIDIA's nvidia-ctk (go-nvml) can be run against a simulated machine.
 *
 * Semantics follow the Python simulator driver/gpudra_driver/nvml/fake.py:
 *  - every call before nvmlInit (or after the matching nvmlShutdown) returns UNINITIALIZED;
 *    init/shutdown are reference counted; the inventory is (re)read on the first init;
 *  - MIG queries on a GPU without MIG support return NOT_SUPPORTED; GetMaxMigDeviceCount is 0 when
 *    MIG is unsupported or disabled; GetMigDeviceHandleByIndex: NOT_FOUND for an empty slot and
 *    whenever MIG is disabled, INVALID_ARGUMENT past the max count;
 *  - MIG-instance queries (GI/CI id, parent handle) on a full-GPU handle return INVALID_ARGUMENT;
 *    GetAttributes on a full GPU returns NOT_SUPPORTED; per-GPU queries (minor, PCI, NUMA, MIG mode,
 *    index) on a MIG handle return NOT_SUPPORTED;
 *  - a device's `fail <call> <code>` lines make that call (named without its _vN suffix) fail;
 *  - string buffers too small for the answer give INSUFFICIENT_SIZE;
 *  - GPU/compute instance calls (GetGpuInstanceById, GpuInstanceGetInfo, ComputeInstanceGetInfo,
 *    Get{Gpu,Compute}InstanceProfileInfo v1) answer from the MIG devices, enough for go-nvlib's
 *    MigDevice.GetProfile, which nvidia-ctk calls for every MIG device;
 *  - GPU instance profiles of a GPU with a MIG catalog (migCatalog/migProfile lines: every profile NVML
 *    reports on that model), whatever its MIG mode and MIG devices: nvmlDeviceGetGpuInstanceProfileInfo
 *    (v1 struct), ...ProfileInfoV and ...ProfileInfoByIdV (v2 or v3 struct, any other version:
 *    ARGUMENT_VERSION_MISMATCH) answer the catalog's entry, NOT_SUPPORTED for an index the model lacks,
 *    INVALID_ARGUMENT for an index >= NVML_GPU_INSTANCE_PROFILE_COUNT (0x12) or an ID the model lacks;
 *    nvmlDeviceGetGpuInstancePossiblePlacements_v2 (by profile ID) answers every placement of the
 *    profile: placements NULL -> *count = the number; *count too small -> INSUFFICIENT_SIZE with *count
 *    set to the number. All of them: NOT_SUPPORTED on a GPU without MIG support and on a MIG handle.
 *    GpuInstanceGetInfo then names the catalog's profile ID (matched by the MIG device's GPU instance
 *    profile name) and placement size (start 0: the inventory has no placements). A MIG-capable GPU
 *    without a catalog derives profile info from its MIG devices (ID = the index, indexes 7..0x11:
 *    NOT_SUPPORTED) and has no placements (NOT_SUPPORTED);
 *  - nvmlDevice{Get,Set}ComputeMode: per GPU, shared with other processes through a file under the
 *    driver root (mock_state.h), default DEFAULT (0); Set takes DEFAULT, PROHIBITED (2) or
 *    EXCLUSIVE_PROCESS (3), anything else (EXCLUSIVE_THREAD, 1, whose support NVML removed,
 *    included) is INVALID_ARGUMENT; MIG handles get NOT_SUPPORTED for both (the mode is the parent
 *    GPU's); a state directory it cannot write is NO_PERMISSION (the real call needs root); each
 *    successful Set appends `nvml SetComputeMode <uuid> <mode>` to the root's calls.log;
 *  - health, injected at run time by appending lines to <state>/events (mock_state.h; the Python
 *    helpers are in gpudra_operator/localcluster/mockstate.py):
 *      xid <uuid> <n>     an XID critical error (nvmlEventTypeXidCriticalError, eventData n) on a GPU,
 *                         or on a MIG device: then on its parent GPU with the MIG device's GPU and
 *                         compute instance IDs (0xFFFFFFFF for both when not on a MIG device)
 *      ecc <uuid>         a double-bit ECC error (nvmlEventTypeDoubleBitEccError), attributed the same
 *      lost <uuid>        the GPU falls off the bus: handle lookups (by index or UUID) and every call
 *                         on it or its MIG devices return GPU_IS_LOST, and an event set it is
 *                         registered in returns GPU_IS_LOST from one wait
 *      action <uuid> <n>  NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (field 230) reads n from now on
 *      recover <uuid>     the GPU is back: not lost, recovery action 0 (NONE)
 *    lost/action/recover are state: every process folds the whole file (so a restarted agent sees a
 *    GPU that is still lost); xid/ecc are events: an event set delivers those appended after its
 *    nvmlEventSetCreate, in order, to sets the GPU is registered in for that event type.
 *    nvmlDeviceGetSupportedEventTypes answers single- and double-bit ECC and XID (0xB) for a GPU
 *    (NOT_SUPPORTED for a MIG handle, as events are registered on the parent); `fail
 *    nvmlDeviceGetSupportedEventTypes 3` models a GPU without events. nvmlEventSetWait_v2 blocks up
 *    to its timeout (inotify on the state directory) and returns TIMEOUT when nothing came;
 *  - exported calls the mock does not model return NOT_SUPPORTED.
 *
 * Driver root (for the shared state): this library's directory minus usr/lib/x86_64-linux-gnu, found
 * with dladdr like the inventory; $GPUDRA_MOCK_STATE_DIR overrides the state directory.
 *
 * Inventory: $GPUDRA_MOCK_NVML_INVENTORY, else gpudra-mock-nvml.inventory next to this library file.
 * Missing or unreadable: nvmlInit returns DRIVER_NOT_LOADED and says on stderr which file it wanted.
 * Line format (one `key value` per line; `#` comments; a `gpu` line opens a GPU, `mig <slot>` opens a
 * MIG device of the current GPU, the keys after it describe that device):
 *
 *   driverVersion 570.133.20
 *   cudaDriverVersion 12080
 *   initError 9                      (optional: nvmlInit fails with this code)
 *   gpu
 *   name NVIDIA A100-SXM4-80GB       (rest of the line)
 *   uuid GPU-...
 *   brand 14 / architecture 7 / cudaComputeCapability 8 0 / memoryMiB 81920 / memoryUsedMiB 0
 *   minor 0 / busId 00000000:07:00.0 / pciDeviceId 548540638 / pciSubSystemId 0
 *   numaNode 0                       (absent: NVML has no NUMA answer -> NOT_SUPPORTED)
 *   migCapable 1 / migMode 1 1 (current pending) / maxMigDevices 7
 *   fail nvmlDeviceGetMemoryInfo 15
 *   migCatalog a100-sxm4-80gb 8 7   (optional: <model> <memory slices> <compute slices>; before migProfile)
 *   migProfile 0 19 1 7 14 1 0 0 0 0 9728 1g.10gb 1 0,1,2,3,4,5,6
 *                                    (one per GPU instance profile of the catalog, before any `mig`:
 *                                    <NVML_GPU_INSTANCE_PROFILE_* index> <profile id> <slices> <instances>
 *                                    <SMs> <copy engines> <decoders> <encoders> <jpeg> <ofa> <memory MiB>
 *                                    <name> <placement size> <placement starts, comma-separated>; index
 *                                    < 0x12, index and id unique, slices <= compute slices, placements
 *                                    distinct and inside the memory slices, instances <= placements)
 *   mig 0
 *   uuid MIG-... / profile 3g.40gb / gpuInstanceId 2 / computeInstanceId 0
 *   attributes 42 3 2 0 0 0 3 3 40192  (the c_nvmlDeviceAttributes fields in order)
 *   fail nvmlDeviceGetUUID 999
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sys/inotify.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "mock_nvml.h"
#include "mock_state.h"

#define EXPORT __attribute__((visibility("default")))

#define MAX_GPUS 64
#define MAX_MIG_SLOTS 16
#define MAX_FAULTS 8
#define MAX_MEMORY_SLICES 16 /* 8 on every MIG-capable GPU so far */
#define PROFILE_SLOTS MOCK_GPU_INSTANCE_PROFILE_COUNT
#define TEXT_LEN 96
#define LINE_LEN 512
#define INVENTORY_ENV "GPUDRA_MOCK_NVML_INVENTORY"
#define INVENTORY_FILE "gpudra-mock-nvml.inventory"

struct fault {
    char call[64];
    int code;
};

struct device;

/* A GPU or compute instance handle: part of the MIG device it belongs to. */
struct instance {
    struct device *mig;
};

struct device {
    int is_mig;
    int present; /* MIG slot filled */
    int gpu_index;
    unsigned int slot;
    char uuid[TEXT_LEN];
    char profile[TEXT_LEN];
    unsigned int gi, ci;
    mock_device_attrs_t attrs;
    int nfaults;
    struct fault faults[MAX_FAULTS];
    struct instance gi_handle, ci_handle;
};

/* One GPU instance profile of a MIG catalog (migProfile), at its NVML_GPU_INSTANCE_PROFILE_* index. */
struct mig_profile {
    int present;
    unsigned int id, slices, instances, sm, ce, dec, enc, jpeg, ofa;
    unsigned long long memory_mib;
    char name[TEXT_LEN];
    unsigned int size, nstarts, starts[MAX_MEMORY_SLICES];
};

struct gpu {
    struct device dev; /* the full-GPU handle */
    char name[TEXT_LEN];
    unsigned int brand, arch;
    int cc_major, cc_minor;
    unsigned long long memory_mib, memory_used_mib;
    unsigned int minor;
    char bus_id[MOCK_PCI_BUS_ID_SIZE];
    unsigned int domain, bus, device, function;
    unsigned int pci_device_id, pci_subsystem_id;
    int has_numa, numa;
    int mig_capable;
    unsigned int mig_current, mig_pending;
    unsigned int max_migs;
    struct device migs[MAX_MIG_SLOTS];
    int has_catalog; /* migCatalog */
    char catalog[TEXT_LEN];
    unsigned int memory_slices, compute_slices;
    struct mig_profile profiles[PROFILE_SLOTS];
    int lost;                     /* from <state>/events: lost / recover */
    unsigned int recovery_action; /* from <state>/events: action / recover */
};

/* Handles point into these static arrays, so they stay valid across init/shutdown. */
static struct gpu gpus[MAX_GPUS];
static unsigned int gpu_count;
static char driver_version[TEXT_LEN];
static int cuda_driver_version;
static int refcount;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static off_t health_offset; /* how much of <state>/events the lost/action state has folded in */
static pthread_mutex_t health_lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct device *nvmlDevice_t;
typedef struct instance *nvmlGpuInstance_t;
typedef struct instance *nvmlComputeInstance_t;

/* -- inventory -------------------------------------------------------------------------------- */

/* This library's own path, as the dynamic loader opened it. */
static const char *library_file(void) {
    Dl_info info;
    if (dladdr((void *)&library_file, &info) && info.dli_fname && strchr(info.dli_fname, '/')) return info.dli_fname;
    return NULL;
}

static void inventory_path(char *out, size_t size) {
    const char *env = getenv(INVENTORY_ENV);
    if (env && *env) {
        snprintf(out, size, "%s", env);
        return;
    }
    const char *lib = library_file();
    if (lib) {
        const char *slash = strrchr(lib, '/');
        snprintf(out, size, "%.*s/%s", (int)(slash - lib), lib, INVENTORY_FILE);
        return;
    }
    snprintf(out, size, "%s", INVENTORY_FILE);
}

/* The directory the mocks share their state in (mock_state.h): <root>/run/gpudra-mock; 0, or -1
 * when the path does not fit. */
static int state_path(char *out, size_t size) {
    char root[MOCK_PATH_LEN - 32];
    const char *lib = library_file();
    if (mock_root_of(lib ? lib : "./" INVENTORY_FILE, "/usr/lib/x86_64-linux-gnu", root, sizeof root) != 0) return -1;
    return mock_state_dir(root, out, size);
}

static void copy_text(char *dst, size_t size, const char *src) { snprintf(dst, size, "%s", src); }

/* "00000000:07:00.0" or "0000:07:00.0" (any case) -> numbers; 0 on success. */
static int parse_bus_id(const char *text, unsigned int *domain, unsigned int *bus, unsigned int *device,
                        unsigned int *function) {
    char tail;
    if (sscanf(text, "%x:%x:%x.%x%c", domain, bus, device, function, &tail) != 4) return -1;
    return 0;
}

static int add_fault(struct device *d, const char *value) {
    char call[64];
    int code;
    if (d->nfaults >= MAX_FAULTS || sscanf(value, "%63s %d", call, &code) != 2) return -1;
    copy_text(d->faults[d->nfaults].call, sizeof d->faults[0].call, call);
    d->faults[d->nfaults].code = code;
    d->nfaults++;
    return 0;
}

/* A whole token of decimal digits (no sign, nothing after it) at most `max`; 0 on success. */
static int parse_number(const char *tok, unsigned long long max, unsigned long long *out) {
    char *end;
    if (!tok || *tok < '0' || *tok > '9') return -1;
    errno = 0;
    *out = strtoull(tok, &end, 10);
    return *end || errno || *out > max ? -1 : 0;
}

/* A MIG GPU instance profile name: <n>g.<m>gb, optionally followed by +me, +gfx, -me, +me.all, ... */
static int valid_profile_name(const char *name) {
    size_t n = strspn(name, "0123456789");
    if (!n || name[n] != 'g' || name[n + 1] != '.') return 0;
    name += n + 2;
    n = strspn(name, "0123456789");
    if (!n || strncmp(name + n, "gb", 2)) return 0;
    name += n + 2;
    if (!*name) return 1;
    return (*name == '+' || *name == '-') && name[1] &&
           strspn(name + 1, "abcdefghijklmnopqrstuvwxyz.") == strlen(name + 1);
}

/* `migCatalog <model> <memory slices> <compute slices>` (once per GPU); 0 on success. */
static int parse_catalog(struct gpu *g, const char *value) {
    char copy[LINE_LEN], *save = NULL;
    unsigned long long memory, compute;
    if (g->has_catalog) return -1;
    copy_text(copy, sizeof copy, value);
    const char *model = strtok_r(copy, " \t", &save);
    if (!model || strlen(model) >= sizeof g->catalog) return -1;
    if (parse_number(strtok_r(NULL, " \t", &save), MAX_MEMORY_SLICES, &memory) != 0 || memory < 1) return -1;
    if (parse_number(strtok_r(NULL, " \t", &save), memory, &compute) != 0 || compute < 1) return -1;
    if (strtok_r(NULL, " \t", &save)) return -1;
    copy_text(g->catalog, sizeof g->catalog, model);
    g->memory_slices = (unsigned int)memory;
    g->compute_slices = (unsigned int)compute;
    g->has_catalog = 1;
    return 0;
}

/* `migProfile <index> <id> <slices> <instances> <sm> <ce> <dec> <enc> <jpeg> <ofa> <memMiB> <name> <size>
 * <start,start,...>` (after migCatalog); every field a whole token; 0 on success. */
static int parse_mig_profile(struct gpu *g, const char *value) {
    enum { FIELDS = 14, NAME = 11, STARTS = 13 };
    char copy[LINE_LEN], *save = NULL, *tok[FIELDS + 1];
    unsigned long long num[FIELDS];
    struct mig_profile p;
    if (!g->has_catalog) return -1;
    copy_text(copy, sizeof copy, value);
    int n = 0;
    for (char *t = strtok_r(copy, " \t", &save); t; t = strtok_r(NULL, " \t", &save)) {
        if (n > FIELDS) return -1;
        tok[n++] = t;
    }
    if (n != FIELDS) return -1;
    for (int i = 0; i < FIELDS; i++)
        if (i != NAME && i != STARTS && parse_number(tok[i], i == 10 ? ~0ULL : 0xFFFFFFFFULL, &num[i]) != 0) return -1;
    if (!valid_profile_name(tok[NAME]) || strlen(tok[NAME]) >= sizeof p.name) return -1;
    memset(&p, 0, sizeof p);
    unsigned int index = (unsigned int)num[0];
    p.id = (unsigned int)num[1];
    p.slices = (unsigned int)num[2];
    p.instances = (unsigned int)num[3];
    p.sm = (unsigned int)num[4];
    p.ce = (unsigned int)num[5];
    p.dec = (unsigned int)num[6];
    p.enc = (unsigned int)num[7];
    p.jpeg = (unsigned int)num[8];
    p.ofa = (unsigned int)num[9];
    p.memory_mib = num[10];
    copy_text(p.name, sizeof p.name, tok[NAME]);
    p.size = (unsigned int)num[12];
    if (num[0] >= PROFILE_SLOTS || g->profiles[index].present) return -1;
    if (p.slices < 1 || p.slices > g->compute_slices || p.size < 1 || p.size > g->memory_slices) return -1;
    for (unsigned int i = 0; i < PROFILE_SLOTS; i++)
        if (g->profiles[i].present && g->profiles[i].id == p.id) return -1;
    /* the starts: comma-separated, each a number, distinct, the placement inside the memory slices */
    char *starts = tok[STARTS], *comma;
    if (starts[strlen(starts) - 1] == ',') return -1;
    for (char *s = starts; s; s = comma ? comma + 1 : NULL) {
        unsigned long long start;
        comma = strchr(s, ',');
        if (comma) *comma = 0;
        if (p.nstarts >= MAX_MEMORY_SLICES || parse_number(s, g->memory_slices - 1, &start) != 0) return -1;
        if (start + p.size > g->memory_slices) return -1;
        for (unsigned int i = 0; i < p.nstarts; i++)
            if (p.starts[i] == start) return -1;
        p.starts[p.nstarts++] = (unsigned int)start;
    }
    if (p.instances < 1 || p.instances > p.nstarts) return -1;
    p.present = 1;
    g->profiles[index] = p;
    return 0;
}

static nvmlReturn_t load_inventory(int *init_error) {
    char path[4096], line[LINE_LEN];
    inventory_path(path, sizeof path);
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "gpudra mock NVML: cannot read the inventory %s (%s); set %s or put %s next to the library\n",
                path, strerror(errno), INVENTORY_ENV, INVENTORY_FILE);
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    memset(gpus, 0, sizeof gpus);
    gpu_count = 0;
    health_offset = 0; /* fold <state>/events again: a GPU lost before this init is still lost */
    driver_version[0] = 0;
    cuda_driver_version = 0;
    *init_error = 0;
    struct gpu *g = NULL;
    struct device *d = NULL; /* the device `fail` and MIG keys apply to */
    int lineno = 0, bad = 0;
    while (!bad && fgets(line, sizeof line, f)) {
        lineno++;
        line[strcspn(line, "\r\n")] = 0;
        char *key = line + strspn(line, " \t");
        if (!*key || *key == '#') continue;
        char *value = key + strcspn(key, " \t");
        if (*value) *value++ = 0;
        value += strspn(value, " \t");
        int n = 0;
        if (!strcmp(key, "driverVersion")) copy_text(driver_version, sizeof driver_version, value);
        else if (!strcmp(key, "cudaDriverVersion")) bad = sscanf(value, "%d", &cuda_driver_version) != 1;
        else if (!strcmp(key, "initError")) bad = sscanf(value, "%d", init_error) != 1;
        else if (!strcmp(key, "gpu")) {
            if (gpu_count >= MAX_GPUS) { bad = 1; break; }
            g = &gpus[gpu_count];
            d = &g->dev;
            d->gpu_index = (int)gpu_count;
            g->minor = gpu_count;
            gpu_count++;
        } else if (!g) bad = 1;
        else if (!strcmp(key, "mig")) {
            unsigned int slot;
            if (sscanf(value, "%u", &slot) != 1 || slot >= MAX_MIG_SLOTS) { bad = 1; break; }
            d = &g->migs[slot];
            d->is_mig = 1;
            d->present = 1;
            d->gpu_index = g->dev.gpu_index;
            d->slot = slot;
            d->gi_handle.mig = d;
            d->ci_handle.mig = d;
        } else if (!strcmp(key, "uuid")) copy_text(d->uuid, sizeof d->uuid, value);
        else if (!strcmp(key, "fail")) bad = add_fault(d, value) != 0;
        else if (d->is_mig) {
            mock_device_attrs_t *a = &d->attrs;
            if (!strcmp(key, "profile")) copy_text(d->profile, sizeof d->profile, value);
            else if (!strcmp(key, "gpuInstanceId")) bad = sscanf(value, "%u", &d->gi) != 1;
            else if (!strcmp(key, "computeInstanceId")) bad = sscanf(value, "%u", &d->ci) != 1;
            else if (!strcmp(key, "attributes"))
                bad = sscanf(value, "%u %u %u %u %u %u %u %u %llu%n", &a->multiprocessorCount,
                             &a->sharedCopyEngineCount, &a->sharedDecoderCount, &a->sharedEncoderCount,
                             &a->sharedJpegCount, &a->sharedOfaCount, &a->gpuInstanceSliceCount,
                             &a->computeInstanceSliceCount, &a->memorySizeMB, &n) != 9;
            else bad = 1;
        } else if (!strcmp(key, "name")) copy_text(g->name, sizeof g->name, value);
        else if (!strcmp(key, "brand")) bad = sscanf(value, "%u", &g->brand) != 1;
        else if (!strcmp(key, "architecture")) bad = sscanf(value, "%u", &g->arch) != 1;
        else if (!strcmp(key, "cudaComputeCapability")) bad = sscanf(value, "%d %d", &g->cc_major, &g->cc_minor) != 2;
        else if (!strcmp(key, "memoryMiB")) bad = sscanf(value, "%llu", &g->memory_mib) != 1;
        else if (!strcmp(key, "memoryUsedMiB")) bad = sscanf(value, "%llu", &g->memory_used_mib) != 1;
        else if (!strcmp(key, "minor")) bad = sscanf(value, "%u", &g->minor) != 1;
        else if (!strcmp(key, "busId")) {
            copy_text(g->bus_id, sizeof g->bus_id, value);
            bad = parse_bus_id(value, &g->domain, &g->bus, &g->device, &g->function) != 0;
        } else if (!strcmp(key, "pciDeviceId")) bad = sscanf(value, "%u", &g->pci_device_id) != 1;
        else if (!strcmp(key, "pciSubSystemId")) bad = sscanf(value, "%u", &g->pci_subsystem_id) != 1;
        else if (!strcmp(key, "numaNode")) { bad = sscanf(value, "%d", &g->numa) != 1; g->has_numa = 1; }
        else if (!strcmp(key, "migCapable")) bad = sscanf(value, "%d", &g->mig_capable) != 1;
        else if (!strcmp(key, "migMode")) bad = sscanf(value, "%u %u", &g->mig_current, &g->mig_pending) != 2;
        else if (!strcmp(key, "maxMigDevices")) {
            bad = sscanf(value, "%u", &g->max_migs) != 1 || g->max_migs > MAX_MIG_SLOTS;
        } else if (!strcmp(key, "migCatalog")) bad = parse_catalog(g, value) != 0;
        else if (!strcmp(key, "migProfile")) bad = parse_mig_profile(g, value) != 0;
        else bad = 1;
    }
    fclose(f);
    if (bad) {
        fprintf(stderr, "gpudra mock NVML: %s line %d: cannot parse it\n", path, lineno);
        return NVML_ERROR_UNKNOWN;
    }
    return NVML_SUCCESS;
}

/* -- checks shared by every call -------------------------------------------------------------- */

#define READY() do { if (refcount <= 0) return NVML_ERROR_UNINITIALIZED; } while (0)

/* The device behind a handle, or NULL when the handle is not one this library gave out. */
static struct device *lookup(nvmlDevice_t h) {
    if (!h) return NULL;
    for (unsigned int i = 0; i < gpu_count; i++) {
        if (h == &gpus[i].dev) return h;
        for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++)
            if (h == &gpus[i].migs[s]) return gpus[i].migs[s].present ? h : NULL;
    }
    return NULL;
}

static struct gpu *gpu_of(const struct device *d) { return &gpus[d->gpu_index]; }

/* -- injected health (<state>/events) --------------------------------------------------------- */

#define EVENTS_FILE "events"

static int events_path(char *out, size_t size) {
    char state[MOCK_PATH_LEN - 16];
    if (state_path(state, sizeof state) != 0) return -1;
    int n = snprintf(out, size, "%s/%s", state, EVENTS_FILE);
    return n >= 0 && (size_t)n < size ? 0 : -1;
}

/* The device (GPU or MIG) with this UUID, or NULL. */
static struct device *find_uuid(const char *uuid) {
    for (unsigned int i = 0; i < gpu_count; i++) {
        if (!strcmp(gpus[i].dev.uuid, uuid)) return &gpus[i].dev;
        for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++)
            if (gpus[i].migs[s].present && !strcmp(gpus[i].migs[s].uuid, uuid)) return &gpus[i].migs[s];
    }
    return NULL;
}

/* One complete line of the events file at *offset (without its newline); 1 read (offset moved
 * past it), 0 none complete yet. */
static int read_event_line(int fd, off_t *offset, char *line, size_t size) {
    ssize_t n = pread(fd, line, size - 1, *offset);
    if (n <= 0) return 0;
    line[n] = 0;
    char *end = memchr(line, '\n', (size_t)n);
    if (!end) {
        if ((size_t)n < size - 1) return 0; /* a line still being written */
        *offset += n;                       /* an overlong line: skip what we have */
        line[0] = 0;
        return 1;
    }
    *end = 0;
    *offset += end - line + 1;
    return 1;
}

/* Fold the lost/action/recover lines appended since the last call into the GPUs' state. */
static void refresh_health(void) {
    char path[MOCK_PATH_LEN], line[LINE_LEN], verb[16], uuid[TEXT_LEN];
    if (events_path(path, sizeof path) != 0) return;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    pthread_mutex_lock(&health_lock);
    struct stat st;
    if (fstat(fd, &st) == 0 && st.st_size < health_offset) { /* replaced by a shorter file: start over */
        health_offset = 0;
        for (unsigned int i = 0; i < gpu_count; i++) gpus[i].lost = 0, gpus[i].recovery_action = 0;
    }
    while (read_event_line(fd, &health_offset, line, sizeof line)) {
        unsigned int value = 0;
        int fields = sscanf(line, "%15s %95s %u", verb, uuid, &value);
        if (fields < 2) continue;
        struct device *d = find_uuid(uuid);
        if (!d) continue;
        struct gpu *g = gpu_of(d);
        if (!strcmp(verb, "lost")) g->lost = 1;
        else if (!strcmp(verb, "recover")) g->lost = 0, g->recovery_action = 0;
        else if (!strcmp(verb, "action") && fields == 3) g->recovery_action = value;
    }
    pthread_mutex_unlock(&health_lock);
    close(fd);
}

/* GPU_IS_LOST while the device's GPU is lost, else 0. */
static int lost(const struct device *d) {
    refresh_health();
    return gpu_of(d)->lost ? NVML_ERROR_GPU_IS_LOST : 0;
}

static int fault(const struct device *d, const char *call) {
    for (int i = 0; i < d->nfaults; i++)
        if (!strcmp(d->faults[i].call, call)) return d->faults[i].code;
    return 0;
}

/* Any valid handle; `call` is the NVML name without its _vN suffix (what `fail` lines name). */
#define ANY(h, call, d)                                   \
    READY();                                              \
    struct device *d = lookup(h);                         \
    if (!d) return NVML_ERROR_INVALID_ARGUMENT;           \
    { int code_ = lost(d); if (code_) return code_; }     \
    { int code_ = fault(d, call); if (code_) return code_; }

/* A full-GPU handle: MIG handles get NOT_SUPPORTED. */
#define GPU(h, call, g)                                   \
    ANY(h, call, d_);                                     \
    if (d_->is_mig) return NVML_ERROR_NOT_SUPPORTED;      \
    struct gpu *g = gpu_of(d_);

/* A MIG handle: full-GPU handles get `error`. */
#define MIG(h, call, d, error)                            \
    ANY(h, call, d);                                      \
    if (!d->is_mig) return error;

#define OUT(p) do { if (!(p)) return NVML_ERROR_INVALID_ARGUMENT; } while (0)

static nvmlReturn_t put_text(char *buf, unsigned int length, const char *text) {
    OUT(buf);
    if (strlen(text) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, text, strlen(text) + 1);
    return NVML_SUCCESS;
}

/* -- library ---------------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    nvmlReturn_t ret = NVML_SUCCESS;
    pthread_mutex_lock(&lock);
    if (refcount == 0) {
        int init_error = 0;
        ret = load_inventory(&init_error);
        if (ret == NVML_SUCCESS && init_error) ret = init_error;
    }
    if (ret == NVML_SUCCESS) refcount++;
    pthread_mutex_unlock(&lock);
    return ret;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
    nvmlReturn_t ret = NVML_SUCCESS;
    pthread_mutex_lock(&lock);
    if (refcount <= 0) ret = NVML_ERROR_UNINITIALIZED;
    else refcount--;
    pthread_mutex_unlock(&lock);
    return ret;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    default: return "Unknown Error";
    }
}

/* -- system ----------------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    READY();
    return put_text(version, length, driver_version);
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    READY();
    char text[TEXT_LEN + 16];
    snprintf(text, sizeof text, "%d.%s", cuda_driver_version / 1000, driver_version);
    return put_text(version, length, text);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    READY();
    OUT(version);
    *version = cuda_driver_version;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) { return nvmlSystemGetCudaDriverVersion(version); }

/* -- enumeration ------------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    READY();
    OUT(count);
    *count = gpu_count;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    READY();
    OUT(device);
    if (index >= gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(&gpus[index].dev)) return NVML_ERROR_GPU_IS_LOST;
    *device = &gpus[index].dev;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    READY();
    OUT(uuid);
    OUT(device);
    struct device *d = find_uuid(uuid);
    if (!d) return NVML_ERROR_NOT_FOUND;
    if (lost(d)) return NVML_ERROR_GPU_IS_LOST;
    *device = d;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    READY();
    OUT(pciBusId);
    OUT(device);
    unsigned int domain, bus, dev, function;
    if (parse_bus_id(pciBusId, &domain, &bus, &dev, &function) != 0) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < gpu_count; i++) {
        struct gpu *g = &gpus[i];
        if (g->domain == domain && g->bus == bus && g->device == dev && g->function == function) {
            *device = &g->dev;
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    GPU(device, "nvmlDeviceGetIndex", g);
    OUT(index);
    *index = (unsigned int)g->dev.gpu_index;
    return NVML_SUCCESS;
}

/* -- identity --------------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    ANY(device, "nvmlDeviceGetName", d);
    char text[2 * TEXT_LEN + 8];
    if (d->is_mig) snprintf(text, sizeof text, "%s MIG %s", gpu_of(d)->name, d->profile);
    else snprintf(text, sizeof text, "%s", gpu_of(d)->name);
    return put_text(name, length, text);
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    ANY(device, "nvmlDeviceGetUUID", d);
    return put_text(uuid, length, d->uuid);
}

EXPORT nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, int *type) {
    ANY(device, "nvmlDeviceGetBrand", d);
    OUT(type);
    *type = (int)gpu_of(d)->brand;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *arch) {
    ANY(device, "nvmlDeviceGetArchitecture", d);
    OUT(arch);
    *arch = gpu_of(d)->arch;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    ANY(device, "nvmlDeviceGetCudaComputeCapability", d);
    OUT(major);
    OUT(minor);
    *major = gpu_of(d)->cc_major;
    *minor = gpu_of(d)->cc_minor;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    GPU(device, "nvmlDeviceGetMinorNumber", g);
    OUT(minor);
    *minor = g->minor;
    return NVML_SUCCESS;
}

static void memory_of(const struct device *d, unsigned long long *total, unsigned long long *used) {
    const unsigned long long mib = 1024ULL * 1024ULL;
    if (d->is_mig) {
        *total = d->attrs.memorySizeMB * mib;
        *used = 0;
    } else {
        *total = gpu_of(d)->memory_mib * mib;
        *used = gpu_of(d)->memory_used_mib * mib;
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, mock_memory_t *memory) {
    ANY(device, "nvmlDeviceGetMemoryInfo", d);
    OUT(memory);
    memory_of(d, &memory->total, &memory->used);
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, mock_memory_v2_t *memory) {
    ANY(device, "nvmlDeviceGetMemoryInfo", d);
    OUT(memory);
    if (memory->version != MOCK_MEMORY_V2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory_of(d, &memory->total, &memory->used);
    memory->reserved = 0;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

/* The fields both PCI layouts share, and the legacy 4-digit-domain bus ID into `legacy`. */
#define FILL_PCI(pci, g, legacy)                                                                          \
    do {                                                                                                  \
        memset((pci), 0, sizeof *(pci));                                                                  \
        snprintf((legacy), sizeof(legacy), "%04X:%02X:%02X.%X", (g)->domain & 0xFFFF, (g)->bus & 0xFF,    \
                 (g)->device & 0xFF, (g)->function & 0xF);                                                \
        (pci)->domain = (g)->domain;                                                                      \
        (pci)->bus = (g)->bus;                                                                            \
        (pci)->device = (g)->device;                                                                      \
        (pci)->pciDeviceId = (g)->pci_device_id;                                                          \
        (pci)->pciSubSystemId = (g)->pci_subsystem_id;                                                    \
    } while (0)

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, mock_pci_info_t *pci) {
    GPU(device, "nvmlDeviceGetPciInfo", g);
    OUT(pci);
    FILL_PCI(pci, g, pci->busIdLegacy);  /* NVML keeps the legacy form alongside the 8-digit one */
    copy_text(pci->busId, sizeof pci->busId, g->bus_id);
    return NVML_SUCCESS;
}

/* The pre-9.0 layout: a 16-byte busId (legacy form) and four reserved words. */
EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, mock_pci_info_v2_t *pci) {
    GPU(device, "nvmlDeviceGetPciInfo", g);
    OUT(pci);
    FILL_PCI(pci, g, pci->busId);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, mock_pci_info_v2_t *pci) {
    return nvmlDeviceGetPciInfo_v2(device, pci);
}

EXPORT nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    GPU(device, "nvmlDeviceGetNumaNodeId", g);
    OUT(node);
    if (!g->has_numa) return NVML_ERROR_NOT_SUPPORTED;
    *node = (unsigned int)g->numa;
    return NVML_SUCCESS;
}

/* -- MIG -------------------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    GPU(device, "nvmlDeviceGetMigMode", g);
    if (!g->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    OUT(current);
    OUT(pending);
    *current = g->mig_current;
    *pending = g->mig_pending;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    GPU(device, "nvmlDeviceGetMaxMigDeviceCount", g);
    OUT(count);
    *count = g->mig_capable && g->mig_current == NVML_DEVICE_MIG_ENABLE ? g->max_migs : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                        nvmlDevice_t *migDevice) {
    GPU(device, "nvmlDeviceGetMigDeviceHandleByIndex", g);
    if (!g->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    OUT(migDevice);
    if (g->mig_current != NVML_DEVICE_MIG_ENABLE) return NVML_ERROR_NOT_FOUND;
    if (index >= g->max_migs) return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->migs[index].present) return NVML_ERROR_NOT_FOUND;
    *migDevice = &g->migs[index];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    ANY(device, "nvmlDeviceIsMigDeviceHandle", d);
    OUT(isMigDevice);
    *isMigDevice = d->is_mig ? 1 : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device) {
    MIG(migDevice, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", d, NVML_ERROR_INVALID_ARGUMENT);
    OUT(device);
    *device = &gpu_of(d)->dev;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    MIG(device, "nvmlDeviceGetGpuInstanceId", d, NVML_ERROR_INVALID_ARGUMENT);
    OUT(id);
    *id = d->gi;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    MIG(device, "nvmlDeviceGetComputeInstanceId", d, NVML_ERROR_INVALID_ARGUMENT);
    OUT(id);
    *id = d->ci;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, mock_device_attrs_t *attributes) {
    MIG(device, "nvmlDeviceGetAttributes", d, NVML_ERROR_NOT_SUPPORTED);
    OUT(attributes);
    *attributes = d->attrs;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t device, mock_device_attrs_t *attributes) {
    return nvmlDeviceGetAttributes_v2(device, attributes);
}

/* -- compute mode (shared state: mock_state.h) ------------------------------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, int *mode) {
    GPU(device, "nvmlDeviceGetComputeMode", g);
    OUT(mode);
    char state[MOCK_PATH_LEN];
    int value;
    if (state_path(state, sizeof state) != 0) return NVML_ERROR_UNKNOWN;
    if (mock_get_value(state, g->dev.uuid, "compute_mode", NVML_COMPUTEMODE_DEFAULT, &value) < 0)
        return NVML_ERROR_UNKNOWN;
    *mode = value;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t device, int mode) {
    GPU(device, "nvmlDeviceSetComputeMode", g);
    if (mode != NVML_COMPUTEMODE_DEFAULT && mode != NVML_COMPUTEMODE_PROHIBITED &&
        mode != NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
        return NVML_ERROR_INVALID_ARGUMENT;
    char state[MOCK_PATH_LEN];
    if (state_path(state, sizeof state) != 0) return NVML_ERROR_UNKNOWN;
    if (mock_set_value(state, g->dev.uuid, "compute_mode", mode) != 0)
        return errno == EACCES || errno == EPERM || errno == EROFS ? NVML_ERROR_NO_PERMISSION : NVML_ERROR_UNKNOWN;
    mock_log_call(state, "nvml SetComputeMode %s %d", g->dev.uuid, mode);
    return NVML_SUCCESS;
}

/* -- exported but not modelled: NOT_SUPPORTED (after the usual init and handle checks) --------- */

#define UNSUPPORTED_DEVICE_CALL(fn, call, ...)                    \
    EXPORT nvmlReturn_t fn(nvmlDevice_t device, __VA_ARGS__) {    \
        ANY(device, call, d);                                     \
        (void)d;                                                  \
        return NVML_ERROR_NOT_SUPPORTED;                          \
    }

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
UNSUPPORTED_DEVICE_CALL(nvmlDeviceGetSerial, "nvmlDeviceGetSerial", char *serial, unsigned int length)
UNSUPPORTED_DEVICE_CALL(nvmlDeviceGetBoardPartNumber, "nvmlDeviceGetBoardPartNumber", char *partNumber,
                        unsigned int length)
UNSUPPORTED_DEVICE_CALL(nvmlDeviceGetVbiosVersion, "nvmlDeviceGetVbiosVersion", char *version, unsigned int length)
UNSUPPORTED_DEVICE_CALL(nvmlDeviceGetTemperature, "nvmlDeviceGetTemperature", int sensorType, unsigned int *temp)
UNSUPPORTED_DEVICE_CALL(nvmlDeviceGetPowerUsage, "nvmlDeviceGetPowerUsage", unsigned int *power)
UNSUPPORTED_DEVICE_CALL(nvmlDeviceGetPersistenceMode, "nvmlDeviceGetPersistenceMode", int *mode)
UNSUPPORTED_DEVICE_CALL(nvmlDeviceGetUtilizationRates, "nvmlDeviceGetUtilizationRates", void *utilization)
UNSUPPORTED_DEVICE_CALL(nvmlDeviceGetEccMode, "nvmlDeviceGetEccMode", int *current, int *pending)
#pragma GCC diagnostic pop

/* -- MIG GPU and compute instances -------------------------------------------------------------
 * Enough for go-nvlib's MigDevice.GetProfile (nvidia-ctk): instance handles point into the MIG
 * device they belong to. A GPU with a MIG catalog answers its GPU instance profiles from it (IDs as
 * NVML gives them). Without one, GPU instance profile IDs are NVML's profile *indexes*
 * (NVML_GPU_INSTANCE_PROFILE_<n>_SLICE) derived from the slice counts, and only the profiles some MIG
 * device of the GPU uses are known (others: NOT_SUPPORTED). Compute instance profile IDs are always
 * the indexes (NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE) derived from the slice counts. */

/* Slice count -> profile index (the same table for GPU and compute instance profiles). */
static const unsigned int profile_slices[] = {1, 2, 3, 4, 7, 8, 6};
#define PROFILE_COUNT (sizeof profile_slices / sizeof profile_slices[0])

static int profile_index(unsigned int slices) {
    for (unsigned int i = 0; i < PROFILE_COUNT; i++)
        if (profile_slices[i] == slices) return (int)i;
    return -1;
}

static struct device *instance_mig(const struct instance *inst, int compute) {
    if (!inst) return NULL;
    for (unsigned int i = 0; i < gpu_count; i++)
        for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++) {
            struct device *m = &gpus[i].migs[s];
            if (m->present && inst == (compute ? &m->ci_handle : &m->gi_handle)) return m;
        }
    return NULL;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id, nvmlGpuInstance_t *gpuInstance) {
    GPU(device, "nvmlDeviceGetGpuInstanceById", g);
    if (!g->mig_capable || g->mig_current != NVML_DEVICE_MIG_ENABLE) return NVML_ERROR_NOT_SUPPORTED;
    OUT(gpuInstance);
    for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++)
        if (g->migs[s].present && g->migs[s].gi == id) {
            *gpuInstance = &g->migs[s].gi_handle;
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                          nvmlComputeInstance_t *computeInstance) {
    READY();
    struct device *m = instance_mig(gpuInstance, 0);
    if (!m) return NVML_ERROR_INVALID_ARGUMENT;
    OUT(computeInstance);
    struct gpu *g = gpu_of(m);
    for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++)
        if (g->migs[s].present && g->migs[s].gi == m->gi && g->migs[s].ci == id) {
            *computeInstance = &g->migs[s].ci_handle;
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

/* The GPU instance profile name of a MIG device's profile: "1c.3g.20gb" -> "3g.20gb". */
static const char *gi_profile_name(const char *profile) {
    const char *p = profile + strspn(profile, "0123456789");
    return p != profile && p[0] == 'c' && p[1] == '.' ? p + 2 : profile;
}

/* The catalog profile a MIG device's GPU instance is, by name; NULL when none. */
static const struct mig_profile *catalog_profile_of(const struct device *m) {
    const struct gpu *g = gpu_of(m);
    if (!g->has_catalog) return NULL;
    for (unsigned int i = 0; i < PROFILE_SLOTS; i++)
        if (g->profiles[i].present && !strcmp(g->profiles[i].name, gi_profile_name(m->profile))) return &g->profiles[i];
    return NULL;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, mock_gpu_instance_info_t *info) {
    READY();
    struct device *m = instance_mig(gpuInstance, 0);
    if (!m) return NVML_ERROR_INVALID_ARGUMENT;
    OUT(info);
    const struct mig_profile *cp = catalog_profile_of(m);
    int profile = profile_index(m->attrs.gpuInstanceSliceCount);
    if (!cp && profile < 0) return NVML_ERROR_NOT_SUPPORTED;
    memset(info, 0, sizeof *info);
    info->device = &gpu_of(m)->dev;
    info->id = m->gi;
    info->profileId = cp ? cp->id : (unsigned int)profile;
    info->placement.size = cp ? cp->size : m->attrs.gpuInstanceSliceCount;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance,
                                                  mock_compute_instance_info_t *info) {
    READY();
    struct device *m = instance_mig(computeInstance, 1);
    if (!m) return NVML_ERROR_INVALID_ARGUMENT;
    OUT(info);
    int profile = profile_index(m->attrs.computeInstanceSliceCount);
    if (profile < 0) return NVML_ERROR_NOT_SUPPORTED;
    memset(info, 0, sizeof *info);
    info->device = &gpu_of(m)->dev;
    info->gpuInstance = &m->gi_handle;
    info->id = m->ci;
    info->profileId = (unsigned int)profile;
    info->placement.size = m->attrs.computeInstanceSliceCount;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t computeInstance,
                                               mock_compute_instance_info_t *info) {
    return nvmlComputeInstanceGetInfo_v2(computeInstance, info);
}

/* Profile `profile` (an NVML index below PROFILE_SLOTS) of a MIG-capable GPU, and its name (without
 * "MIG "): the catalog's entry; without a catalog, derived from the first MIG device whose GPU instance
 * has that many slices. NOT_SUPPORTED when there is none. */
static nvmlReturn_t profile_info(const struct gpu *g, unsigned int profile, mock_gpu_instance_profile_info_t *info,
                                 const char **name) {
    memset(info, 0, sizeof *info);
    if (g->has_catalog) {
        const struct mig_profile *p = &g->profiles[profile];
        if (!p->present) return NVML_ERROR_NOT_SUPPORTED;
        info->id = p->id;
        info->sliceCount = p->slices;
        info->instanceCount = p->instances;
        info->multiprocessorCount = p->sm;
        info->copyEngineCount = p->ce;
        info->decoderCount = p->dec;
        info->encoderCount = p->enc;
        info->jpegCount = p->jpeg;
        info->ofaCount = p->ofa;
        info->memorySizeMB = p->memory_mib;
        *name = p->name;
        return NVML_SUCCESS;
    }
    if (profile >= PROFILE_COUNT) return NVML_ERROR_NOT_SUPPORTED; /* +me/gfx variants: not derived */
    for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++) {
        const struct device *m = &g->migs[s];
        if (!m->present || m->attrs.gpuInstanceSliceCount != profile_slices[profile]) continue;
        info->id = profile;
        info->sliceCount = profile_slices[profile];
        info->instanceCount = g->max_migs / profile_slices[profile];
        /* a GPU instance's share of the GPU: its compute instance scaled back up to the whole GI */
        info->multiprocessorCount = m->attrs.multiprocessorCount * m->attrs.gpuInstanceSliceCount /
                                    (m->attrs.computeInstanceSliceCount ? m->attrs.computeInstanceSliceCount : 1);
        info->copyEngineCount = m->attrs.sharedCopyEngineCount;
        info->decoderCount = m->attrs.sharedDecoderCount;
        info->encoderCount = m->attrs.sharedEncoderCount;
        info->jpegCount = m->attrs.sharedJpegCount;
        info->ofaCount = m->attrs.sharedOfaCount;
        info->memorySizeMB = m->attrs.memorySizeMB;
        *name = gi_profile_name(m->profile);
        return NVML_SUCCESS;
    }
    return NVML_ERROR_NOT_SUPPORTED;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                        mock_gpu_instance_profile_info_t *info) {
    GPU(device, "nvmlDeviceGetGpuInstanceProfileInfo", g);
    if (!g->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    OUT(info);
    if (profile >= PROFILE_SLOTS) return NVML_ERROR_INVALID_ARGUMENT;
    mock_gpu_instance_profile_info_t out;
    const char *name;
    nvmlReturn_t ret = profile_info(g, profile, &out, &name);
    if (ret == NVML_SUCCESS) *info = out;
    return ret;
}

/* A versioned profile info struct NVML fills: v2 or v3 (info->version); to any other version NVML
 * answers ARGUMENT_VERSION_MISMATCH. */
static int profile_info_version_ok(const void *info) {
    unsigned int version;
    memcpy(&version, info, sizeof version);
    return version == MOCK_GPU_INSTANCE_PROFILE_INFO_V2 || version == MOCK_GPU_INSTANCE_PROFILE_INFO_V3;
}

/* Fill a v2 or v3 profile info struct (as its version says) from `in` and the profile's name. */
static void put_profile_info_v(void *info, const mock_gpu_instance_profile_info_t *in, const char *name) {
    unsigned int version;
    memcpy(&version, info, sizeof version);
    if (version == MOCK_GPU_INSTANCE_PROFILE_INFO_V2) {
        mock_gpu_instance_profile_info_v2_t *v2 = info;
        memset(v2, 0, sizeof *v2);
        v2->version = version;
        v2->id = in->id;
        v2->isP2pSupported = in->isP2pSupported;
        v2->sliceCount = in->sliceCount;
        v2->instanceCount = in->instanceCount;
        v2->multiprocessorCount = in->multiprocessorCount;
        v2->copyEngineCount = in->copyEngineCount;
        v2->decoderCount = in->decoderCount;
        v2->encoderCount = in->encoderCount;
        v2->jpegCount = in->jpegCount;
        v2->ofaCount = in->ofaCount;
        v2->memorySizeMB = in->memorySizeMB;
        snprintf(v2->name, sizeof v2->name, "MIG %s", name);
    } else {
        mock_gpu_instance_profile_info_v3_t *v3 = info;
        memset(v3, 0, sizeof *v3);
        v3->version = version;
        v3->id = in->id;
        v3->sliceCount = in->sliceCount;
        v3->instanceCount = in->instanceCount;
        v3->multiprocessorCount = in->multiprocessorCount;
        v3->copyEngineCount = in->copyEngineCount;
        v3->decoderCount = in->decoderCount;
        v3->encoderCount = in->encoderCount;
        v3->jpegCount = in->jpegCount;
        v3->ofaCount = in->ofaCount;
        v3->memorySizeMB = in->memorySizeMB;
        snprintf(v3->name, sizeof v3->name, "MIG %s", name);
        v3->capabilities = 0; /* no P2P, no graphics */
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile, void *info) {
    GPU(device, "nvmlDeviceGetGpuInstanceProfileInfo", g);
    if (!g->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    OUT(info);
    if (!profile_info_version_ok(info)) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (profile >= PROFILE_SLOTS) return NVML_ERROR_INVALID_ARGUMENT;
    mock_gpu_instance_profile_info_t out;
    const char *name;
    nvmlReturn_t ret = profile_info(g, profile, &out, &name);
    if (ret == NVML_SUCCESS) put_profile_info_v(info, &out, name);
    return ret;
}

/* The NVML index of the GPU's profile with this ID, or -1: the catalog's; without one the ID is the index. */
static int profile_of_id(const struct gpu *g, unsigned int id) {
    if (!g->has_catalog) return id < PROFILE_SLOTS ? (int)id : -1;
    for (unsigned int i = 0; i < PROFILE_SLOTS; i++)
        if (g->profiles[i].present && g->profiles[i].id == id) return (int)i;
    return -1;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoByIdV(nvmlDevice_t device, unsigned int profileId, void *info) {
    GPU(device, "nvmlDeviceGetGpuInstanceProfileInfoById", g);
    if (!g->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    OUT(info);
    if (!profile_info_version_ok(info)) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    int profile = profile_of_id(g, profileId);
    if (profile < 0) return NVML_ERROR_INVALID_ARGUMENT;
    mock_gpu_instance_profile_info_t out;
    const char *name;
    nvmlReturn_t ret = profile_info(g, (unsigned int)profile, &out, &name);
    if (ret == NVML_SUCCESS) put_profile_info_v(info, &out, name);
    return ret;
}

/* Every possible placement of the profile with this ID (whatever GPU instances exist), in NVML's
 * two-call protocol. Only a GPU with a MIG catalog knows its placements. */
EXPORT nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device, unsigned int profileId,
                                                                  mock_placement_t *placements, unsigned int *count) {
    GPU(device, "nvmlDeviceGetGpuInstancePossiblePlacements", g);
    if (!g->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    OUT(count);
    if (!g->has_catalog) return NVML_ERROR_NOT_SUPPORTED;
    int profile = profile_of_id(g, profileId);
    if (profile < 0) return NVML_ERROR_INVALID_ARGUMENT;
    const struct mig_profile *p = &g->profiles[profile];
    if (placements && *count < p->nstarts) {
        *count = p->nstarts;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; placements && i < p->nstarts; i++) {
        placements[i].start = p->starts[i];
        placements[i].size = p->size;
    }
    *count = p->nstarts;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                                 unsigned int engProfile,
                                                                 mock_compute_instance_profile_info_t *info) {
    READY();
    struct device *gm = instance_mig(gpuInstance, 0);
    if (!gm) return NVML_ERROR_INVALID_ARGUMENT;
    OUT(info);
    if (profile >= PROFILE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    if (engProfile != 0) return NVML_ERROR_NOT_SUPPORTED; /* only the shared engine profile */
    struct gpu *g = gpu_of(gm);
    for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++) {
        const struct device *m = &g->migs[s];
        if (!m->present || m->gi != gm->gi || m->attrs.computeInstanceSliceCount != profile_slices[profile]) continue;
        memset(info, 0, sizeof *info);
        info->id = profile;
        info->sliceCount = profile_slices[profile];
        info->instanceCount = gm->attrs.gpuInstanceSliceCount / profile_slices[profile];
        info->multiprocessorCount = m->attrs.multiprocessorCount;
        info->sharedCopyEngineCount = m->attrs.sharedCopyEngineCount;
        info->sharedDecoderCount = m->attrs.sharedDecoderCount;
        info->sharedEncoderCount = m->attrs.sharedEncoderCount;
        info->sharedJpegCount = m->attrs.sharedJpegCount;
        info->sharedOfaCount = m->attrs.sharedOfaCount;
        return NVML_SUCCESS;
    }
    return NVML_ERROR_NOT_SUPPORTED;
}

/* -- health: recovery action field and events (injected through <state>/events) ---------------- */

static long long now_usec(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

/* Only NVML_FI_DEV_GET_GPU_RECOVERY_ACTION is known (per GPU; a MIG handle reads its parent's);
 * other fields get NOT_SUPPORTED in their own nvmlReturn, as the real call reports per field. */
EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, mock_field_value_t *values) {
    ANY(device, "nvmlDeviceGetFieldValues", d);
    if (valuesCount < 0) return NVML_ERROR_INVALID_ARGUMENT;
    OUT(values);
    for (int i = 0; i < valuesCount; i++) {
        mock_field_value_t *v = &values[i];
        v->timestamp = now_usec();
        v->latencyUsec = 0;
        memset(&v->value, 0, sizeof v->value);
        if (v->fieldId == MOCK_FI_DEV_GET_GPU_RECOVERY_ACTION) {
            v->valueType = MOCK_VALUE_TYPE_UNSIGNED_INT;
            v->value.uiVal = gpu_of(d)->recovery_action;
            v->nvmlReturn = NVML_SUCCESS;
        } else {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}

#define MAX_EVENT_SETS 16

struct event_set {
    int used;
    unsigned long long mask[MAX_GPUS]; /* event types registered, per GPU index */
    off_t offset;                      /* the next line of <state>/events to deliver */
    int inotify;                       /* on the state directory; -1: wait by short naps */
};

static struct event_set event_sets[MAX_EVENT_SETS];
typedef struct event_set *nvmlEventSet_t;

static struct event_set *event_set_of(nvmlEventSet_t set) {
    for (int i = 0; i < MAX_EVENT_SETS; i++)
        if (set == &event_sets[i] && event_sets[i].used) return set;
    return NULL;
}

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    READY();
    OUT(set);
    char state[MOCK_PATH_LEN], path[MOCK_PATH_LEN];
    if (state_path(state, sizeof state) != 0 || events_path(path, sizeof path) != 0) return NVML_ERROR_UNKNOWN;
    pthread_mutex_lock(&lock);
    struct event_set *es = NULL;
    for (int i = 0; i < MAX_EVENT_SETS && !es; i++)
        if (!event_sets[i].used) es = &event_sets[i];
    if (es) {
        memset(es, 0, sizeof *es);
        es->used = 1;
        /* watch before measuring the file, so no line appended in between goes unnoticed */
        es->inotify = -1;
        if (mock_mkdirs(state, 0755) == 0) {
            es->inotify = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
            if (es->inotify >= 0 && inotify_add_watch(es->inotify, state, IN_MODIFY | IN_CREATE | IN_MOVED_TO) < 0) {
                close(es->inotify);
                es->inotify = -1;
            }
        }
        struct stat st;
        es->offset = stat(path, &st) == 0 ? st.st_size : 0; /* only events from now on, as NVML */
    }
    pthread_mutex_unlock(&lock);
    if (!es) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    *set = es;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    READY();
    pthread_mutex_lock(&lock);
    struct event_set *es = event_set_of(set);
    if (es) {
        if (es->inotify >= 0) close(es->inotify);
        es->used = 0;
    }
    pthread_mutex_unlock(&lock);
    return es ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    GPU(device, "nvmlDeviceGetSupportedEventTypes", g);
    (void)g;
    OUT(eventTypes);
    *eventTypes = MOCK_EVENT_SUPPORTED;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set) {
    GPU(device, "nvmlDeviceRegisterEvents", g);
    if (eventTypes & ~MOCK_EVENT_SUPPORTED) return NVML_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&lock);
    struct event_set *es = event_set_of(set);
    if (es) es->mask[g->dev.gpu_index] |= eventTypes;
    pthread_mutex_unlock(&lock);
    return es ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

/* The next event for `es` from the events file: SUCCESS (data filled), GPU_IS_LOST (a registered
 * GPU was lost; data->device is it) or TIMEOUT when no such line is there yet. */
static nvmlReturn_t next_event(struct event_set *es, mock_event_data_t *data) {
    char path[MOCK_PATH_LEN], line[LINE_LEN], verb[16], uuid[TEXT_LEN];
    if (events_path(path, sizeof path) != 0) return NVML_ERROR_UNKNOWN;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NVML_ERROR_TIMEOUT;
    nvmlReturn_t ret = NVML_ERROR_TIMEOUT;
    while (ret == NVML_ERROR_TIMEOUT && read_event_line(fd, &es->offset, line, sizeof line)) {
        unsigned long long value = 0;
        int fields = sscanf(line, "%15s %95s %llu", verb, uuid, &value);
        struct device *d = fields >= 2 ? find_uuid(uuid) : NULL;
        if (!d) continue;
        struct gpu *g = gpu_of(d);
        unsigned long long registered = es->mask[g->dev.gpu_index];
        unsigned long long type = !strcmp(verb, "xid") && fields == 3 ? MOCK_EVENT_XID
                                  : !strcmp(verb, "ecc")                ? MOCK_EVENT_DOUBLE_BIT_ECC
                                                                        : 0;
        memset(data, 0, sizeof *data);
        data->device = &g->dev;
        data->gpuInstanceId = d->is_mig ? d->gi : MOCK_NO_INSTANCE;
        data->computeInstanceId = d->is_mig ? d->ci : MOCK_NO_INSTANCE;
        if (!strcmp(verb, "lost") && registered) ret = NVML_ERROR_GPU_IS_LOST;
        else if (type && (registered & type)) {
            data->eventType = type;
            data->eventData = type == MOCK_EVENT_XID ? value : 0;
            ret = NVML_SUCCESS;
        }
    }
    close(fd);
    return ret;
}

static long long now_msec(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, mock_event_data_t *data, unsigned int timeoutms) {
    READY();
    struct event_set *es = event_set_of(set);
    if (!es) return NVML_ERROR_INVALID_ARGUMENT;
    OUT(data);
    long long deadline = now_msec() + timeoutms;
    for (;;) {
        nvmlReturn_t ret = next_event(es, data);
        if (ret != NVML_ERROR_TIMEOUT) return ret;
        long long left = deadline - now_msec();
        if (left <= 0) return NVML_ERROR_TIMEOUT;
        if (es->inotify >= 0) { /* until the state directory changes (queued since create) or the timeout */
            struct pollfd pfd = {.fd = es->inotify, .events = POLLIN};
            if (poll(&pfd, 1, (int)(left > 60000 ? 60000 : left)) > 0) {
                char drain[4096];
                while (read(es->inotify, drain, sizeof drain) > 0) {}
            }
        } else {
            struct timespec nap = {0, 10 * 1000 * 1000}; /* no inotify: look again every 10 ms */
            nanosleep(&nap, NULL);
        }
    }
}

EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, mock_event_data_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}
