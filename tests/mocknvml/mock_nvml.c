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
 *  - dynamic MIG: GPU and compute instances are created and destroyed through NVML
 *    (nvmlDeviceCreateGpuInstance[WithPlacement], nvmlGpuInstanceCreateComputeInstance, ...Destroy,
 *    nvmlDeviceGetGpuInstances, nvmlGpuInstanceGetComputeInstances, ...) on a GPU with a MIG catalog and
 *    MIG mode enabled, kept in <state>/state/<GPU uuid>/mig_instances for every process; each created
 *    compute instance is a MIG device like the inventory's. Rules, IDs, UUIDs and the file format: the
 *    "MIG GPU and compute instances" section below;
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
 *  - nvmlDeviceSetMigMode: NVML's semantics (pending set, activated at once on Hopper and later, left
 *    pending with activation status RESET_REQUIRED on older GPUs; IN_USE while the GPU has a GPU
 *    instance), the mode kept in <state>/state/<uuid>/mig_mode for every process, which GetMigMode and
 *    every MIG call read (see nvmlDeviceSetMigMode below);
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
#include <sys/file.h>
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
#define MAX_GIS 15            /* GPU instance IDs 0..14: the kernel's capability layout has 15 GIs per GPU */
#define MAX_CIS 8             /* compute instance IDs 0..7 per GPU instance (the same layout) */
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

/* A GPU or compute instance handle. An inventory (static) one is part of the MIG device it belongs
 * to (`mig`); a created one lives in its GPU (`created`, mig NULL) and is valid while the state file
 * lists it. */
struct instance {
    struct device *mig;
    int gpu_index;
    unsigned int gi, ci;
    int created;
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
    int mig_inventory;                        /* the inventory's migMode as <current><pending>; -1 not kept yet */
    unsigned int max_migs;
    struct device migs[MAX_MIG_SLOTS];
    int has_catalog; /* migCatalog */
    char catalog[TEXT_LEN];
    unsigned int memory_slices, compute_slices;
    struct mig_profile profiles[PROFILE_SLOTS];
    int lost;                     /* from <state>/events: lost / recover */
    unsigned int recovery_action; /* from <state>/events: action / recover */
    /* GPU and compute instances created through NVML (<state>/state/<uuid>/mig_instances), re-read
     * whenever the file changed (another process may have changed it) */
    struct created_gi {
        int present;
        int profile; /* the catalog index */
        unsigned int start, size;
    } cgi[MAX_GIS];
    struct created_ci {
        int present;
        unsigned int profile_id, slot;
    } cci[MAX_GIS][MAX_CIS];
    struct device dyn[MAX_MIG_SLOTS];         /* the MIG devices of the created instances, by slot */
    struct instance gi_h[MAX_GIS];            /* created GPU instance handles, by GI ID */
    struct instance ci_h[MAX_GIS][MAX_CIS];   /* created compute instance handles, by GI and CI ID */
    int state_loaded, state_present;          /* what the last read of the file saw */
    struct stat state_st;
    int resets;                               /* <state>/state/<uuid>/resets: GPU resets so far */
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

static void init_instance_handles(void);

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
            g->mig_inventory = -1;
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
            d->gi_handle.gpu_index = d->ci_handle.gpu_index = d->gpu_index;
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
    init_instance_handles();
    return NVML_SUCCESS;
}

/* -- checks shared by every call -------------------------------------------------------------- */

#define READY() do { if (refcount <= 0) return NVML_ERROR_UNINITIALIZED; } while (0)

static void refresh_instances(struct gpu *g);

/* The device behind a handle, or NULL when the handle is not one this library gave out (or names a
 * created MIG device since destroyed). */
static struct device *lookup(nvmlDevice_t h) {
    if (!h) return NULL;
    for (unsigned int i = 0; i < gpu_count; i++) {
        if (h == &gpus[i].dev) return h;
        for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++) {
            if (h == &gpus[i].migs[s]) return gpus[i].migs[s].present ? h : NULL;
            if (h == &gpus[i].dyn[s]) {
                refresh_instances(&gpus[i]);
                return gpus[i].dyn[s].present ? h : NULL;
            }
        }
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
    if (strncmp(uuid, "MIG-", 4)) return NULL;
    for (unsigned int i = 0; i < gpu_count; i++) {
        refresh_instances(&gpus[i]);
        for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++)
            if (gpus[i].dyn[s].present && !strcmp(gpus[i].dyn[s].uuid, uuid)) return &gpus[i].dyn[s];
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

/* The MIG mode as nvmlDeviceSetMigMode last set it in any process (<state>/state/<uuid>/mig_mode,
 * <current><pending> as one number: 11, 10, 1, 0), else the inventory's. */
static void refresh_mig_mode(struct gpu *g) {
    char state[MOCK_PATH_LEN];
    int value;
    if (g->mig_inventory < 0) g->mig_inventory = (int)(g->mig_current * 10 + g->mig_pending);
    if (state_path(state, sizeof state) != 0 || mock_get_value(state, g->dev.uuid, "mig_mode", g->mig_inventory, &value) < 0)
        value = g->mig_inventory;
    g->mig_current = (unsigned int)value / 10;
    g->mig_pending = (unsigned int)value % 10;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    GPU(device, "nvmlDeviceGetMigMode", g);
    if (!g->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    OUT(current);
    OUT(pending);
    refresh_mig_mode(g);
    *current = g->mig_current;
    *pending = g->mig_pending;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    GPU(device, "nvmlDeviceGetMaxMigDeviceCount", g);
    OUT(count);
    refresh_mig_mode(g);
    *count = g->mig_capable && g->mig_current == NVML_DEVICE_MIG_ENABLE ? g->max_migs : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                        nvmlDevice_t *migDevice) {
    GPU(device, "nvmlDeviceGetMigDeviceHandleByIndex", g);
    if (!g->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    OUT(migDevice);
    refresh_mig_mode(g);
    if (g->mig_current != NVML_DEVICE_MIG_ENABLE) return NVML_ERROR_NOT_FOUND;
    if (index >= g->max_migs) return NVML_ERROR_INVALID_ARGUMENT;
    if (g->migs[index].present) {
        *migDevice = &g->migs[index];
        return NVML_SUCCESS;
    }
    refresh_instances(g);
    if (!g->dyn[index].present) return NVML_ERROR_NOT_FOUND;
    *migDevice = &g->dyn[index];
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
 * Inventory (static) instances: enough for go-nvlib's MigDevice.GetProfile (nvidia-ctk); their
 * handles point into the MIG device they belong to. A GPU with a MIG catalog answers its GPU instance
 * profiles from it (IDs as NVML gives them). Without one, GPU instance profile IDs are NVML's profile
 * *indexes* (NVML_GPU_INSTANCE_PROFILE_<n>_SLICE) derived from the slice counts, and only the profiles
 * some MIG device of the GPU uses are known (others: NOT_SUPPORTED). Compute instance profile IDs are
 * always the indexes (NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE) derived from the slice counts.
 *
 * Created instances (dynamic MIG) on a GPU with a MIG catalog and MIG mode enabled, with NVML's
 * semantics (nvml.h, NVIDIA/go-nvml gen/nvml/nvml.h @2f9e261, the "Multi Instance GPU Management"
 * group; NVML API reference group__nvmlMultiInstanceGPU):
 *  - nvmlDeviceCreateGpuInstanceWithPlacement: NOT_SUPPORTED when MIG mode is not enabled (nvml.h:
 *    "If device doesn't have MIG mode enabled"), on a GPU without MIG support and on one without a
 *    catalog (no placements known); INVALID_ARGUMENT for an unknown profile ID, a NULL placement and a
 *    placement not among the profile's possible placements; INSUFFICIENT_RESOURCES ("If the requested
 *    GPU instance could not be created") when the placement overlaps the memory slices of an existing
 *    GPU instance (nvml.h on nvmlDeviceGetGpuInstancePossiblePlacements_v2: "Creation of new GPU
 *    instance will fail if there is overlap with the already occupied memory slices"), when the profile
 *    already has its instanceCount instances, or when the compute slices or any engine count (copy
 *    engines, decoders, encoders, JPEG, OFA) summed over the GPU's instances would exceed the GPU's: the
 *    catalog's compute slices and its largest (full, 7g) profile's engines. nvmlDeviceCreateGpuInstance
 *    takes the first placement (lowest start) that passes;
 *  - GPU instance IDs (chosen, matching real GPUs): the placement's node in the binary tree of the
 *    memory slices, id = (memorySlices/size - 1) + start/size: the full GPU 0, the halves 1-2, the
 *    quarters 3-6, the eighths 7-14. `nvidia-smi mig -lgi` on real GPUs shows exactly these (A100
 *    1g.5gb at 0..6 -> 7..13; H100 NVL 2g.24gb at 0/2/4 -> 3/4/5 and 1g.12gb at 6 -> 13; MIG user
 *    guide 4g.20gb at 0:4 -> 1, 2g.10gb at 4:2 -> 5, 1g.5gb at 6:1 -> 13). The same placement always
 *    gets the same ID, and IDs stay inside the kernel's capability layout (gi0..gi14). A geometry that
 *    is not such a tree (none shipped) takes the lowest free ID from 1;
 *  - compute instances: only the full-size one (the GPU instance's slices, engine profile SHARED),
 *    what dynamic MIG needs: nvmlGpuInstanceGetComputeInstanceProfileInfo(V) answers it (ID = its
 *    NVML_COMPUTE_INSTANCE_PROFILE_* index, instanceCount 1, the GI profile's SMs and engines, name
 *    "MIG <GI profile>"), other profile indexes below NVML_COMPUTE_INSTANCE_PROFILE_COUNT (9) are
 *    NOT_SUPPORTED, indexes past it and engine profiles other than 0 INVALID_ARGUMENT (nvml.h);
 *    nvmlGpuInstanceCreateComputeInstance creates it with the lowest free CI ID (0; real GPUs number
 *    a GPU instance's compute instances from 0), a second one is INSUFFICIENT_RESOURCES; a CI on an
 *    inventory GPU instance is INSUFFICIENT_RESOURCES (its compute instances are the inventory's);
 *  - each created compute instance is a MIG device in the lowest MIG device slot (below
 *    maxMigDevices) that neither an inventory MIG device nor another created one holds, kept until it
 *    is destroyed: nvmlDeviceGetMigDeviceHandleByIndex, GetHandleByUUID, GetUUID, Get{Gpu,Compute}
 *    InstanceId, GetAttributes (the catalog profile's), GetName, GetMemoryInfo and the parent handle
 *    answer as for an inventory MIG device. Its UUID is MIG-<8-4-4-4-12 hex> from FNV-1a 64 over
 *    "<parent uuid>/<gi>/<ci>" (twice, the second continuing with "#"), version nibble 5, variant 10:
 *    the same in every process, and in the Python simulator (fake.py mig_uuid); after a GPU reset
 *    (`nvidia-smi -r`, which empties the state file and counts the reset in
 *    <state>/state/<uuid>/resets) over "<parent uuid>/<gi>/<ci>/<resets>", so an instance made again
 *    at the same place has another UUID, as a real GPU's would;
 *  - nvmlComputeInstanceDestroy, then nvmlGpuInstanceDestroy: IN_USE for a GPU instance that still has
 *    compute instances (nvml.h: "compute instances are active on the GPU instance") and for inventory
 *    instances (chosen: they model instances someone else made and uses); a destroyed instance's
 *    handle is INVALID_ARGUMENT from then on;
 *  - nvmlDeviceGetGpuInstances / nvmlGpuInstanceGetComputeInstances: the instances (inventory and
 *    created) of that profile, by ascending ID, *count set to how many (the buffer must hold the
 *    profile's instanceCount, as nvml.h says); nvmlDeviceGetGpuInstanceById / nvmlGpuInstance
 *    GetComputeInstanceById: NOT_FOUND for an ID that does not exist; the GPU instance calls on a GPU
 *    whose MIG mode is not enabled: NOT_SUPPORTED;
 *  - every instance call checks the parent GPU's `fail` lines (named without _vN) and lost state;
 *    each successful create/destroy appends to calls.log:
 *      nvml CreateGpuInstance <GPU uuid> <profile id> <start> <size> <gi>
 *      nvml CreateComputeInstance <GPU uuid> <gi> <ci profile id> <ci>
 *      nvml DestroyComputeInstance <GPU uuid> <gi> <ci>
 *      nvml DestroyGpuInstance <GPU uuid> <gi>
 *
 * Created instances live in <state>/state/<GPU uuid>/mig_instances, shared by every process (the
 * agent, a restarted agent, tests, the Python simulator given the same state directory), replaced
 * atomically (a temporary file renamed over it) under an flock(2) on .mig_instances.lock next to it,
 * and read again whenever it changed (inode, size or mtime). One instance a line:
 *   gi <gi id> <GPU instance profile id> <placement start> <placement size>
 *   ci <gi id> <ci id> <compute instance profile id> <MIG device slot>
 * `#` lines are comments; lines naming an unknown profile, an ID out of range or a CI without its GI
 * are ignored. A state directory that cannot be written: NO_PERMISSION (the real calls need root). */

/* Slice count -> profile index (the same table for GPU and compute instance profiles). */
static const unsigned int profile_slices[] = {1, 2, 3, 4, 7, 8, 6};
#define PROFILE_COUNT (sizeof profile_slices / sizeof profile_slices[0])
#define MIG_STATE_FILE "mig_instances"

static int profile_index(unsigned int slices) {
    for (unsigned int i = 0; i < PROFILE_COUNT; i++)
        if (profile_slices[i] == slices) return (int)i;
    return -1;
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

/* The GPU instance ID of a placement: its node in the binary tree of the GPU's memory slices; -1
 * when the placement is not a node of such a tree. */
static int tree_gi_id(unsigned int memory_slices, unsigned int start, unsigned int size) {
    if (!size || memory_slices % size || start % size) return -1;
    unsigned int n = memory_slices / size;
    if (n & (n - 1)) return -1;
    unsigned int id = n - 1 + start / size;
    return id < MAX_GIS ? (int)id : -1;
}

/* The placement of tree node `id` (the inverse of tree_gi_id); 0, or -1 when there is none. */
static int tree_placement(unsigned int memory_slices, unsigned int id, unsigned int *start, unsigned int *size) {
    unsigned int n = 1;
    while (n - 1 + n <= id) n *= 2; /* the level of the node: ids n-1 .. 2n-2 */
    if (!memory_slices || memory_slices % n) return -1;
    *size = memory_slices / n;
    *start = (id - (n - 1)) * *size;
    return 0;
}

/* The memory slices an inventory GPU instance occupies, as its ID says on a real GPU (the tree), when
 * that placement has its catalog profile's size; 0 (unknown: none) otherwise. */
static unsigned int static_placement(const struct device *m, unsigned int *start, unsigned int *size) {
    const struct mig_profile *cp = catalog_profile_of(m);
    const struct gpu *g = gpu_of(m);
    if (!cp || tree_placement(g->memory_slices, m->gi, start, size) != 0 || *size != cp->size) return 0;
    return 1;
}

/* The UUID of a created MIG device (see above; mock_state.h has the one definition). */
static void mig_uuid(const char *parent, unsigned int gi, unsigned int ci, int resets, char *out, size_t size) {
    mock_mig_uuid(parent, gi, ci, resets, out, size);
}

/* -- created instances: the state file ---------------------------------------------------------- */

static pthread_mutex_t mig_lock = PTHREAD_MUTEX_INITIALIZER;

/* <state>/state/<uuid> and the state file in it; 0, or -1 when the paths do not fit. */
static int mig_paths(const struct gpu *g, char *dir, size_t dsize, char *file, size_t fsize) {
    char state[MOCK_PATH_LEN - 256];
    if (!mock_safe_name(g->dev.uuid) || state_path(state, sizeof state) != 0) return -1;
    int n = snprintf(dir, dsize, "%s/state/%s", state, g->dev.uuid);
    if (n < 0 || (size_t)n >= dsize) return -1;
    n = snprintf(file, fsize, "%s/%s", dir, MIG_STATE_FILE);
    return n >= 0 && (size_t)n < fsize ? 0 : -1;
}

/* Fill the MIG devices of the created compute instances from cgi/cci. */
static void build_created_migs(struct gpu *g) {
    struct device dyn[MAX_MIG_SLOTS];
    memset(dyn, 0, sizeof dyn);
    for (unsigned int gi = 0; gi < MAX_GIS; gi++) {
        if (!g->cgi[gi].present) continue;
        const struct mig_profile *p = &g->profiles[g->cgi[gi].profile];
        for (unsigned int ci = 0; ci < MAX_CIS; ci++) {
            const struct created_ci *c = &g->cci[gi][ci];
            if (!c->present || c->slot >= MAX_MIG_SLOTS || dyn[c->slot].present || g->migs[c->slot].present) continue;
            struct device *d = &dyn[c->slot];
            d->is_mig = 1;
            d->present = 1;
            d->gpu_index = g->dev.gpu_index;
            d->slot = c->slot;
            mig_uuid(g->dev.uuid, gi, ci, g->resets, d->uuid, sizeof d->uuid);
            copy_text(d->profile, sizeof d->profile, p->name);
            d->gi = gi;
            d->ci = ci;
            d->attrs.multiprocessorCount = p->sm;
            d->attrs.sharedCopyEngineCount = p->ce;
            d->attrs.sharedDecoderCount = p->dec;
            d->attrs.sharedEncoderCount = p->enc;
            d->attrs.sharedJpegCount = p->jpeg;
            d->attrs.sharedOfaCount = p->ofa;
            d->attrs.gpuInstanceSliceCount = p->slices;
            d->attrs.computeInstanceSliceCount = p->slices;
            d->attrs.memorySizeMB = p->memory_mib;
        }
    }
    memcpy(g->dyn, dyn, sizeof dyn);
}

/* Read the state file when it changed since the last read (or always, `force`); mig_lock held. */
static void load_instances(struct gpu *g, int force) {
    char dir[MOCK_PATH_LEN], file[MOCK_PATH_LEN], line[LINE_LEN];
    if (!g->has_catalog || mig_paths(g, dir, sizeof dir, file, sizeof file) != 0) return;
    int fd = open(file, O_RDONLY | O_CLOEXEC);
    struct stat st;
    int present = fd >= 0 && fstat(fd, &st) == 0;
    if (!force && g->state_loaded && present == g->state_present &&
        (!present || (st.st_ino == g->state_st.st_ino && st.st_size == g->state_st.st_size &&
                      st.st_mtim.tv_sec == g->state_st.st_mtim.tv_sec &&
                      st.st_mtim.tv_nsec == g->state_st.st_mtim.tv_nsec))) {
        if (fd >= 0) close(fd);
        return;
    }
    memset(g->cgi, 0, sizeof g->cgi);
    memset(g->cci, 0, sizeof g->cci);
    char state[MOCK_PATH_LEN];
    if (state_path(state, sizeof state) != 0 || mock_get_value(state, g->dev.uuid, "resets", 0, &g->resets) < 0)
        g->resets = 0;
    g->state_loaded = 1;
    g->state_present = present;
    if (present) g->state_st = st;
    FILE *f = present ? fdopen(fd, "r") : NULL;
    if (!f && fd >= 0) close(fd);
    while (f && fgets(line, sizeof line, f)) {
        unsigned int a, b, c, d;
        char kind[4], tail;
        int n = sscanf(line, "%3s %u %u %u %u %c", kind, &a, &b, &c, &d, &tail);
        if (n != 5) continue;
        if (!strcmp(kind, "gi") && a < MAX_GIS) {
            int profile = -1;
            for (unsigned int i = 0; i < PROFILE_SLOTS; i++)
                if (g->profiles[i].present && g->profiles[i].id == b) profile = (int)i;
            if (profile < 0 || d != g->profiles[profile].size || c + d > g->memory_slices) continue;
            g->cgi[a] = (struct created_gi){1, profile, c, d};
        } else if (!strcmp(kind, "ci") && a < MAX_GIS && b < MAX_CIS && g->cgi[a].present && d < MAX_MIG_SLOTS) {
            g->cci[a][b] = (struct created_ci){1, c, d};
        }
    }
    if (f) fclose(f);
    build_created_migs(g);
}

static void refresh_instances(struct gpu *g) {
    if (!g->has_catalog) return;
    pthread_mutex_lock(&mig_lock);
    load_instances(g, 0);
    pthread_mutex_unlock(&mig_lock);
}

/* Start changing a GPU's instances: mig_lock, then the file lock (a descriptor in *lock_fd), then a
 * fresh read. SUCCESS, or NO_PERMISSION / UNKNOWN (nothing held). */
static nvmlReturn_t begin_change(struct gpu *g, int *lock_fd) {
    char dir[MOCK_PATH_LEN], file[MOCK_PATH_LEN], lock_path[MOCK_PATH_LEN + 32];
    if (mig_paths(g, dir, sizeof dir, file, sizeof file) != 0) return NVML_ERROR_UNKNOWN;
    snprintf(lock_path, sizeof lock_path, "%s/.%s.lock", dir, MIG_STATE_FILE);
    pthread_mutex_lock(&mig_lock);
    int fd = mock_mkdirs(dir, 0755) == 0 ? open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0644) : -1;
    if (fd < 0 || flock(fd, LOCK_EX) != 0) {
        int err = errno;
        if (fd >= 0) close(fd);
        pthread_mutex_unlock(&mig_lock);
        return err == EACCES || err == EPERM || err == EROFS ? NVML_ERROR_NO_PERMISSION : NVML_ERROR_UNKNOWN;
    }
    *lock_fd = fd;
    load_instances(g, 1);
    return NVML_SUCCESS;
}

/* Write cgi/cci atomically (a temporary file renamed over the state file); SUCCESS or an error. */
static nvmlReturn_t save_instances(struct gpu *g) {
    char dir[MOCK_PATH_LEN], file[MOCK_PATH_LEN], tmp[MOCK_PATH_LEN + 64];
    if (mig_paths(g, dir, sizeof dir, file, sizeof file) != 0) return NVML_ERROR_UNKNOWN;
    snprintf(tmp, sizeof tmp, "%s/.%s.%ld.tmp", dir, MIG_STATE_FILE, (long)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return errno == EACCES || errno == EPERM || errno == EROFS ? NVML_ERROR_NO_PERMISSION : NVML_ERROR_UNKNOWN;
    fprintf(f, "# gpudra mock NVML: MIG instances created on %s (tests/mocknvml/mock_nvml.c)\n", g->dev.uuid);
    for (unsigned int gi = 0; gi < MAX_GIS; gi++) {
        if (!g->cgi[gi].present) continue;
        const struct created_gi *c = &g->cgi[gi];
        fprintf(f, "gi %u %u %u %u\n", gi, g->profiles[c->profile].id, c->start, c->size);
        for (unsigned int ci = 0; ci < MAX_CIS; ci++)
            if (g->cci[gi][ci].present)
                fprintf(f, "ci %u %u %u %u\n", gi, ci, g->cci[gi][ci].profile_id, g->cci[gi][ci].slot);
    }
    int ok = fflush(f) == 0 && fsync(fileno(f)) == 0;
    ok = fclose(f) == 0 && ok;
    if (ok && rename(tmp, file) == 0) return NVML_SUCCESS;
    unlink(tmp);
    return NVML_ERROR_UNKNOWN;
}

/* Finish a change: read the file again (what was saved, or what was there when saving failed) and
 * let go of both locks. */
static void end_change(struct gpu *g, int lock_fd) {
    load_instances(g, 1);
    flock(lock_fd, LOCK_UN);
    close(lock_fd);
    pthread_mutex_unlock(&mig_lock);
}

/* Append a line to calls.log (mock_state.h), when there is a state directory. */
#define LOG_CHANGE(...)                                                     \
    do {                                                                    \
        char state_[MOCK_PATH_LEN];                                         \
        if (state_path(state_, sizeof state_) == 0) mock_log_call(state_, __VA_ARGS__); \
    } while (0)

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


/* -- created instances: resources ------------------------------------------------------------------ */

/* What a GPU's instances take: memory slices (a bit each), compute slices and engines. */
struct usage {
    unsigned int memory, compute, ce, dec, enc, jpeg, ofa;
};

static void add_usage(struct usage *u, const struct mig_profile *p, unsigned int start, unsigned int size, int placed) {
    if (placed) u->memory |= ((1u << size) - 1) << start;
    u->compute += p->slices;
    u->ce += p->ce;
    u->dec += p->dec;
    u->enc += p->enc;
    u->jpeg += p->jpeg;
    u->ofa += p->ofa;
}

/* The catalog's largest profile (the full GPU, 7g): its engines are the GPU's. */
static const struct mig_profile *full_profile(const struct gpu *g) {
    const struct mig_profile *best = NULL;
    for (unsigned int i = 0; i < PROFILE_SLOTS; i++) {
        const struct mig_profile *p = &g->profiles[i];
        if (p->present && (!best || p->slices > best->slices || (p->slices == best->slices && p->size > best->size)))
            best = p;
    }
    return best;
}

/* The first inventory MIG device of each inventory GPU instance: 1 when `m` is one. */
static int first_of_gi(const struct gpu *g, const struct device *m) {
    for (const struct device *o = g->migs; o < m; o++)
        if (o->present && o->gi == m->gi) return 0;
    return 1;
}

/* What the GPU's instances (inventory and created) take, and how many are of profile `index`. */
static void gpu_usage(const struct gpu *g, int index, struct usage *u, unsigned int *of_profile) {
    memset(u, 0, sizeof *u);
    *of_profile = 0;
    for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++) {
        const struct device *m = &g->migs[s];
        if (!m->present || !first_of_gi(g, m)) continue;
        const struct mig_profile *cp = catalog_profile_of(m);
        unsigned int start = 0, size = 0;
        int placed = cp && static_placement(m, &start, &size) && start + size <= g->memory_slices;
        if (cp) add_usage(u, cp, start, size, placed);
        else u->compute += m->attrs.gpuInstanceSliceCount;
        if (cp == &g->profiles[index]) (*of_profile)++;
    }
    for (unsigned int gi = 0; gi < MAX_GIS; gi++) {
        const struct created_gi *c = &g->cgi[gi];
        if (!c->present) continue;
        add_usage(u, &g->profiles[c->profile], c->start, c->size, 1);
        if (c->profile == index) (*of_profile)++;
    }
}

static int gi_taken(const struct gpu *g, unsigned int id) {
    for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++)
        if (g->migs[s].present && g->migs[s].gi == id) return 1;
    return id < MAX_GIS && g->cgi[id].present;
}

/* Whether profile `index` fits at `start` beside the GPU's instances: SUCCESS (and its GPU instance
 * ID), else INSUFFICIENT_RESOURCES. */
static nvmlReturn_t fits(const struct gpu *g, int index, unsigned int start, unsigned int *gi) {
    const struct mig_profile *p = &g->profiles[index], *full = full_profile(g);
    struct usage u;
    unsigned int same;
    gpu_usage(g, index, &u, &same);
    if (same >= p->instances || (u.memory & (((1u << p->size) - 1) << start))) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    if (u.compute + p->slices > g->compute_slices || u.ce + p->ce > full->ce || u.dec + p->dec > full->dec ||
        u.enc + p->enc > full->enc || u.jpeg + p->jpeg > full->jpeg || u.ofa + p->ofa > full->ofa)
        return NVML_ERROR_INSUFFICIENT_RESOURCES;
    int id = tree_gi_id(g->memory_slices, start, p->size);
    if (id < 0)
        for (id = 1; id < MAX_GIS && gi_taken(g, (unsigned int)id); id++) {}
    if (id >= MAX_GIS || gi_taken(g, (unsigned int)id)) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    *gi = (unsigned int)id;
    return NVML_SUCCESS;
}

/* Create a GPU instance of profile `index` at `start`, or (start < 0) at the lowest start that fits. */
static nvmlReturn_t create_gpu_instance(struct gpu *g, int index, long start, nvmlGpuInstance_t *out) {
    int fd;
    nvmlReturn_t ret = begin_change(g, &fd);
    if (ret != NVML_SUCCESS) return ret;
    const struct mig_profile *p = &g->profiles[index];
    long at = -1;
    unsigned int gi = 0, id;
    for (unsigned int i = 0; i < p->nstarts; i++) {
        unsigned int s = p->starts[i];
        if ((start >= 0 && s != start) || (at >= 0 && s > at)) continue;
        if (fits(g, index, s, &id) == NVML_SUCCESS) at = s, gi = id;
    }
    ret = NVML_ERROR_INSUFFICIENT_RESOURCES;
    if (at >= 0) {
        g->cgi[gi] = (struct created_gi){1, index, (unsigned int)at, p->size};
        ret = save_instances(g);
    }
    end_change(g, fd);
    if (ret != NVML_SUCCESS) return ret;
    LOG_CHANGE("nvml CreateGpuInstance %s %u %ld %u %u", g->dev.uuid, p->id, at, p->size, gi);
    *out = &g->gi_h[gi];
    return NVML_SUCCESS;
}

/* -- instance handles ----------------------------------------------------------------------------- */

/* Called on every (re)load of the inventory: the created instance handles of each GPU. */
static void init_instance_handles(void) {
    for (unsigned int i = 0; i < gpu_count; i++)
        for (unsigned int gi = 0; gi < MAX_GIS; gi++) {
            gpus[i].gi_h[gi] = (struct instance){NULL, (int)i, gi, 0, 1};
            for (unsigned int ci = 0; ci < MAX_CIS; ci++) gpus[i].ci_h[gi][ci] = (struct instance){NULL, (int)i, gi, ci, 1};
        }
}

/* The GPU (compute 0) or compute (1) instance behind a handle; NULL when it is none this library
 * gave out, or a created one since destroyed. */
static struct instance *instance_of(struct instance *h, int compute) {
    if (!h) return NULL;
    for (unsigned int i = 0; i < gpu_count; i++) {
        struct gpu *g = &gpus[i];
        for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++) {
            struct device *m = &g->migs[s];
            if (m->present && h == (compute ? &m->ci_handle : &m->gi_handle)) return h;
        }
        if (!g->has_catalog) continue;
        for (unsigned int gi = 0; gi < MAX_GIS; gi++) {
            if (!compute && h == &g->gi_h[gi]) {
                refresh_instances(g);
                return g->cgi[gi].present ? h : NULL;
            }
            for (unsigned int ci = 0; compute && ci < MAX_CIS; ci++)
                if (h == &g->ci_h[gi][ci]) {
                    refresh_instances(g);
                    return g->cgi[gi].present && g->cci[gi][ci].present ? h : NULL;
                }
        }
    }
    return NULL;
}

/* A GPU or compute instance handle: `r` the instance, `g` its GPU (whose lost state and `fail` lines
 * apply). */
#define INSTANCE(h, compute, call, r, g)                                 \
    READY();                                                             \
    struct instance *r = instance_of(h, compute);                        \
    if (!r) return NVML_ERROR_INVALID_ARGUMENT;                          \
    struct gpu *g = &gpus[r->gpu_index];                                 \
    { int code_ = lost(&g->dev); if (code_) return code_; }              \
    { int code_ = fault(&g->dev, call); if (code_) return code_; }

static int mig_enabled(struct gpu *g) {
    if (!g->mig_capable) return 0;
    refresh_mig_mode(g);
    return g->mig_current == NVML_DEVICE_MIG_ENABLE;
}

/* NVML's semantics: the pending mode is set, then activated at once on Hopper (architecture 9) and
 * later (the GPU is idle: nothing runs on a mock GPU); on older GPUs it stays pending until a GPU
 * reset, with activation status RESET_REQUIRED. Disabling while the GPU has a GPU instance
 * (inventory or created): IN_USE. Shared with every process through <state>/state/<uuid>/mig_mode;
 * logged as `nvml SetMigMode <uuid> <mode>`. */
EXPORT nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t device, unsigned int mode, nvmlReturn_t *activationStatus) {
    GPU(device, "nvmlDeviceSetMigMode", g);
    if (!g->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    OUT(activationStatus);
    if (mode != NVML_DEVICE_MIG_DISABLE && mode != NVML_DEVICE_MIG_ENABLE) return NVML_ERROR_INVALID_ARGUMENT;
    int fd;
    nvmlReturn_t ret = g->has_catalog ? begin_change(g, &fd) : NVML_SUCCESS; /* no instance made meanwhile */
    if (ret != NVML_SUCCESS) return ret;
    refresh_mig_mode(g);
    if (mode == NVML_DEVICE_MIG_DISABLE && g->mig_current == NVML_DEVICE_MIG_ENABLE) {
        for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++) ret = g->migs[s].present ? NVML_ERROR_IN_USE : ret;
        for (unsigned int gi = 0; gi < MAX_GIS; gi++) ret = g->cgi[gi].present ? NVML_ERROR_IN_USE : ret;
    }
    int live = g->arch >= 9;
    if (ret == NVML_SUCCESS) {
        char state[MOCK_PATH_LEN];
        unsigned int current = live ? mode : g->mig_current;
        if (state_path(state, sizeof state) != 0) ret = NVML_ERROR_UNKNOWN;
        else if (mock_set_value(state, g->dev.uuid, "mig_mode", (int)(current * 10 + mode)) != 0)
            ret = errno == EACCES || errno == EPERM || errno == EROFS ? NVML_ERROR_NO_PERMISSION : NVML_ERROR_UNKNOWN;
        else {
            *activationStatus = live || mode == g->mig_current ? NVML_SUCCESS : NVML_ERROR_RESET_REQUIRED;
            refresh_mig_mode(g);
            mock_log_call(state, "nvml SetMigMode %s %u", g->dev.uuid, mode);
        }
    }
    if (g->has_catalog) end_change(g, fd);
    return ret;
}

/* -- GPU instances -------------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
                                                             const mock_placement_t *placement,
                                                             nvmlGpuInstance_t *gpuInstance) {
    GPU(device, "nvmlDeviceCreateGpuInstanceWithPlacement", g);
    if (!mig_enabled(g) || !g->has_catalog) return NVML_ERROR_NOT_SUPPORTED;
    OUT(placement);
    OUT(gpuInstance);
    int index = profile_of_id(g, profileId);
    if (index < 0) return NVML_ERROR_INVALID_ARGUMENT;
    const struct mig_profile *p = &g->profiles[index];
    int listed = 0;
    for (unsigned int i = 0; i < p->nstarts; i++) listed |= p->starts[i] == placement->start;
    if (!listed || placement->size != p->size) return NVML_ERROR_INVALID_ARGUMENT;
    return create_gpu_instance(g, index, placement->start, gpuInstance);
}

EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t device, unsigned int profileId,
                                                nvmlGpuInstance_t *gpuInstance) {
    GPU(device, "nvmlDeviceCreateGpuInstance", g);
    if (!mig_enabled(g) || !g->has_catalog) return NVML_ERROR_NOT_SUPPORTED;
    OUT(gpuInstance);
    int index = profile_of_id(g, profileId);
    if (index < 0) return NVML_ERROR_INVALID_ARGUMENT;
    return create_gpu_instance(g, index, -1, gpuInstance);
}

EXPORT nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance) {
    INSTANCE(gpuInstance, 0, "nvmlGpuInstanceDestroy", r, g);
    if (!r->created) return NVML_ERROR_IN_USE;
    unsigned int gi = r->gi;
    int fd;
    nvmlReturn_t ret = begin_change(g, &fd);
    if (ret != NVML_SUCCESS) return ret;
    if (!g->cgi[gi].present) ret = NVML_ERROR_INVALID_ARGUMENT; /* destroyed meanwhile */
    for (unsigned int ci = 0; ret == NVML_SUCCESS && ci < MAX_CIS; ci++)
        if (g->cci[gi][ci].present) ret = NVML_ERROR_IN_USE;
    if (ret == NVML_SUCCESS) {
        g->cgi[gi].present = 0;
        ret = save_instances(g);
    }
    end_change(g, fd);
    if (ret == NVML_SUCCESS) LOG_CHANGE("nvml DestroyGpuInstance %s %u", g->dev.uuid, gi);
    return ret;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id, nvmlGpuInstance_t *gpuInstance) {
    GPU(device, "nvmlDeviceGetGpuInstanceById", g);
    if (!mig_enabled(g)) return NVML_ERROR_NOT_SUPPORTED;
    OUT(gpuInstance);
    for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++)
        if (g->migs[s].present && g->migs[s].gi == id) {
            *gpuInstance = &g->migs[s].gi_handle;
            return NVML_SUCCESS;
        }
    refresh_instances(g);
    if (id >= MAX_GIS || !g->cgi[id].present) return NVML_ERROR_NOT_FOUND;
    *gpuInstance = &g->gi_h[id];
    return NVML_SUCCESS;
}

/* The GPU instances (inventory and created) of the profile with this ID, by ascending GPU instance ID. */
EXPORT nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
                                              nvmlGpuInstance_t *gpuInstances, unsigned int *count) {
    GPU(device, "nvmlDeviceGetGpuInstances", g);
    if (!mig_enabled(g)) return NVML_ERROR_NOT_SUPPORTED;
    OUT(gpuInstances);
    OUT(count);
    int index = profile_of_id(g, profileId);
    if (index < 0) return NVML_ERROR_INVALID_ARGUMENT;
    refresh_instances(g);
    unsigned int n = 0;
    for (unsigned int id = 0; id < 64; id++) {
        int found = 0;
        for (unsigned int s = 0; s < MAX_MIG_SLOTS && !found; s++) {
            struct device *m = &g->migs[s];
            if (!m->present || m->gi != id) continue;
            found = 1;
            const struct mig_profile *cp = catalog_profile_of(m);
            if (g->has_catalog ? cp == &g->profiles[index] : profile_index(m->attrs.gpuInstanceSliceCount) == index)
                gpuInstances[n++] = &m->gi_handle;
        }
        if (!found && id < MAX_GIS && g->cgi[id].present && g->cgi[id].profile == index) gpuInstances[n++] = &g->gi_h[id];
    }
    *count = n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, mock_gpu_instance_info_t *info) {
    INSTANCE(gpuInstance, 0, "nvmlGpuInstanceGetInfo", r, g);
    OUT(info);
    if (r->created) {
        const struct created_gi *c = &g->cgi[r->gi];
        memset(info, 0, sizeof *info);
        info->device = &g->dev;
        info->id = r->gi;
        info->profileId = g->profiles[c->profile].id;
        info->placement.start = c->start;
        info->placement.size = c->size;
        return NVML_SUCCESS;
    }
    const struct device *m = r->mig;
    const struct mig_profile *cp = catalog_profile_of(m);
    int profile = profile_index(m->attrs.gpuInstanceSliceCount);
    if (!cp && profile < 0) return NVML_ERROR_NOT_SUPPORTED;
    unsigned int start = 0, size = 0;
    memset(info, 0, sizeof *info);
    info->device = &g->dev;
    info->id = m->gi;
    info->profileId = cp ? cp->id : (unsigned int)profile;
    /* the placement its ID names on a real GPU (see tree_gi_id) where that fits its profile, else start 0 */
    info->placement.start = cp && static_placement(m, &start, &size) ? start : 0;
    info->placement.size = cp ? cp->size : m->attrs.gpuInstanceSliceCount;
    return NVML_SUCCESS;
}

/* -- compute instances ---------------------------------------------------------------------------- */

/* Compute instance profile `profile` of a GPU instance, and its name ("MIG ..."). */
static nvmlReturn_t ci_profile(const struct instance *r, const struct gpu *g, unsigned int profile,
                               unsigned int engProfile, mock_compute_instance_profile_info_t *info, char *name,
                               size_t nsize) {
    memset(info, 0, sizeof *info);
    if (r->created) {
        if (profile >= MOCK_COMPUTE_INSTANCE_PROFILE_COUNT || engProfile >= MOCK_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT)
            return NVML_ERROR_INVALID_ARGUMENT;
        const struct mig_profile *p = &g->profiles[g->cgi[r->gi].profile];
        if ((int)profile != profile_index(p->slices)) return NVML_ERROR_NOT_SUPPORTED; /* only the full-size CI */
        info->id = profile;
        info->sliceCount = p->slices;
        info->instanceCount = 1;
        info->multiprocessorCount = p->sm;
        info->sharedCopyEngineCount = p->ce;
        info->sharedDecoderCount = p->dec;
        info->sharedEncoderCount = p->enc;
        info->sharedJpegCount = p->jpeg;
        info->sharedOfaCount = p->ofa;
        snprintf(name, nsize, "MIG %s", p->name);
        return NVML_SUCCESS;
    }
    const struct device *gm = r->mig;
    if (profile >= PROFILE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    if (engProfile != 0) return NVML_ERROR_NOT_SUPPORTED; /* only the shared engine profile */
    for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++) {
        const struct device *m = &g->migs[s];
        if (!m->present || m->gi != gm->gi || m->attrs.computeInstanceSliceCount != profile_slices[profile]) continue;
        info->id = profile;
        info->sliceCount = profile_slices[profile];
        info->instanceCount = gm->attrs.gpuInstanceSliceCount / profile_slices[profile];
        info->multiprocessorCount = m->attrs.multiprocessorCount;
        info->sharedCopyEngineCount = m->attrs.sharedCopyEngineCount;
        info->sharedDecoderCount = m->attrs.sharedDecoderCount;
        info->sharedEncoderCount = m->attrs.sharedEncoderCount;
        info->sharedJpegCount = m->attrs.sharedJpegCount;
        info->sharedOfaCount = m->attrs.sharedOfaCount;
        snprintf(name, nsize, "MIG %s", m->profile);
        return NVML_SUCCESS;
    }
    return NVML_ERROR_NOT_SUPPORTED;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                                 unsigned int engProfile,
                                                                 mock_compute_instance_profile_info_t *info) {
    INSTANCE(gpuInstance, 0, "nvmlGpuInstanceGetComputeInstanceProfileInfo", r, g);
    OUT(info);
    mock_compute_instance_profile_info_t out;
    char name[MOCK_DEVICE_NAME_V2_SIZE];
    nvmlReturn_t ret = ci_profile(r, g, profile, engProfile, &out, name, sizeof name);
    if (ret == NVML_SUCCESS) *info = out;
    return ret;
}

/* The versioned struct (v2 or v3, as info->version says; any other: ARGUMENT_VERSION_MISMATCH, as the
 * GPU instance profile calls answer). */
EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                                  unsigned int engProfile, void *info) {
    INSTANCE(gpuInstance, 0, "nvmlGpuInstanceGetComputeInstanceProfileInfo", r, g);
    OUT(info);
    unsigned int version;
    memcpy(&version, info, sizeof version);
    if (version != MOCK_COMPUTE_INSTANCE_PROFILE_INFO_V2 && version != MOCK_COMPUTE_INSTANCE_PROFILE_INFO_V3)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    mock_compute_instance_profile_info_t in;
    char name[MOCK_DEVICE_NAME_V2_SIZE];
    nvmlReturn_t ret = ci_profile(r, g, profile, engProfile, &in, name, sizeof name);
    if (ret != NVML_SUCCESS) return ret;
    mock_compute_instance_profile_info_v3_t out;
    memset(&out, 0, sizeof out);
    out.v2.version = version;
    out.v2.id = in.id;
    out.v2.sliceCount = in.sliceCount;
    out.v2.instanceCount = in.instanceCount;
    out.v2.multiprocessorCount = in.multiprocessorCount;
    out.v2.sharedCopyEngineCount = in.sharedCopyEngineCount;
    out.v2.sharedDecoderCount = in.sharedDecoderCount;
    out.v2.sharedEncoderCount = in.sharedEncoderCount;
    out.v2.sharedJpegCount = in.sharedJpegCount;
    out.v2.sharedOfaCount = in.sharedOfaCount;
    copy_text(out.v2.name, sizeof out.v2.name, name);
    memcpy(info, &out, version == MOCK_COMPUTE_INSTANCE_PROFILE_INFO_V2 ? sizeof out.v2 : sizeof out);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                         nvmlComputeInstance_t *computeInstance) {
    INSTANCE(gpuInstance, 0, "nvmlGpuInstanceCreateComputeInstance", r, g);
    OUT(computeInstance);
    if (profileId >= MOCK_COMPUTE_INSTANCE_PROFILE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    if (!r->created) return NVML_ERROR_INSUFFICIENT_RESOURCES; /* the inventory's compute instances fill it */
    unsigned int gi = r->gi, ci = 0, slot = 0;
    int fd;
    nvmlReturn_t ret = begin_change(g, &fd);
    if (ret != NVML_SUCCESS) return ret;
    if (!g->cgi[gi].present) ret = NVML_ERROR_INVALID_ARGUMENT; /* destroyed meanwhile */
    else if ((int)profileId != profile_index(g->profiles[g->cgi[gi].profile].slices)) ret = NVML_ERROR_NOT_SUPPORTED;
    for (unsigned int c = 0; ret == NVML_SUCCESS && c < MAX_CIS; c++)
        if (g->cci[gi][c].present) ret = NVML_ERROR_INSUFFICIENT_RESOURCES; /* the full-size one is there */
    if (ret == NVML_SUCCESS) {
        for (slot = 0; slot < g->max_migs && slot < MAX_MIG_SLOTS; slot++) {
            int taken = g->migs[slot].present;
            for (unsigned int i = 0; i < MAX_GIS && !taken; i++)
                for (unsigned int c = 0; c < MAX_CIS && !taken; c++)
                    taken = g->cgi[i].present && g->cci[i][c].present && g->cci[i][c].slot == slot;
            if (!taken) break;
        }
        if (slot >= g->max_migs || slot >= MAX_MIG_SLOTS) ret = NVML_ERROR_INSUFFICIENT_RESOURCES;
    }
    if (ret == NVML_SUCCESS) {
        g->cci[gi][ci] = (struct created_ci){1, profileId, slot};
        ret = save_instances(g);
    }
    end_change(g, fd);
    if (ret != NVML_SUCCESS) return ret;
    LOG_CHANGE("nvml CreateComputeInstance %s %u %u %u", g->dev.uuid, gi, profileId, ci);
    *computeInstance = &g->ci_h[gi][ci];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance) {
    INSTANCE(computeInstance, 1, "nvmlComputeInstanceDestroy", r, g);
    if (!r->created) return NVML_ERROR_IN_USE;
    unsigned int gi = r->gi, ci = r->ci;
    int fd;
    nvmlReturn_t ret = begin_change(g, &fd);
    if (ret != NVML_SUCCESS) return ret;
    if (!g->cgi[gi].present || !g->cci[gi][ci].present) ret = NVML_ERROR_INVALID_ARGUMENT; /* destroyed meanwhile */
    else {
        g->cci[gi][ci].present = 0;
        ret = save_instances(g);
    }
    end_change(g, fd);
    if (ret == NVML_SUCCESS) LOG_CHANGE("nvml DestroyComputeInstance %s %u %u", g->dev.uuid, gi, ci);
    return ret;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                          nvmlComputeInstance_t *computeInstance) {
    INSTANCE(gpuInstance, 0, "nvmlGpuInstanceGetComputeInstanceById", r, g);
    OUT(computeInstance);
    if (r->created) {
        if (id >= MAX_CIS || !g->cci[r->gi][id].present) return NVML_ERROR_NOT_FOUND;
        *computeInstance = &g->ci_h[r->gi][id];
        return NVML_SUCCESS;
    }
    for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++)
        if (g->migs[s].present && g->migs[s].gi == r->mig->gi && g->migs[s].ci == id) {
            *computeInstance = &g->migs[s].ci_handle;
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

/* The compute instances of the profile with this ID (index) on a GPU instance, by ascending ID. */
EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                       nvmlComputeInstance_t *computeInstances, unsigned int *count) {
    INSTANCE(gpuInstance, 0, "nvmlGpuInstanceGetComputeInstances", r, g);
    OUT(computeInstances);
    OUT(count);
    if (profileId >= MOCK_COMPUTE_INSTANCE_PROFILE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = 0;
    if (r->created) {
        if ((int)profileId != profile_index(g->profiles[g->cgi[r->gi].profile].slices)) return NVML_ERROR_NOT_SUPPORTED;
        for (unsigned int ci = 0; ci < MAX_CIS; ci++)
            if (g->cci[r->gi][ci].present) computeInstances[n++] = &g->ci_h[r->gi][ci];
    } else {
        for (unsigned int ci = 0; ci < 64; ci++)
            for (unsigned int s = 0; s < MAX_MIG_SLOTS; s++) {
                struct device *m = &g->migs[s];
                if (m->present && m->gi == r->mig->gi && m->ci == ci && profileId < PROFILE_COUNT &&
                    m->attrs.computeInstanceSliceCount == profile_slices[profileId])
                    computeInstances[n++] = &m->ci_handle;
            }
        if (!n) return NVML_ERROR_NOT_SUPPORTED; /* as the profile info: a profile none of its CIs has */
    }
    *count = n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance,
                                                  mock_compute_instance_info_t *info) {
    INSTANCE(computeInstance, 1, "nvmlComputeInstanceGetInfo", r, g);
    OUT(info);
    if (r->created) {
        memset(info, 0, sizeof *info);
        info->device = &g->dev;
        info->gpuInstance = &g->gi_h[r->gi];
        info->id = r->ci;
        info->profileId = g->cci[r->gi][r->ci].profile_id;
        info->placement.start = 0;
        info->placement.size = g->profiles[g->cgi[r->gi].profile].slices;
        return NVML_SUCCESS;
    }
    struct device *m = r->mig;
    int profile = profile_index(m->attrs.computeInstanceSliceCount);
    if (profile < 0) return NVML_ERROR_NOT_SUPPORTED;
    memset(info, 0, sizeof *info);
    info->device = &g->dev;
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
