/*
 * gpudra mock driver tools: the static binaries' view of the mock-NVML inventory (the format is
 * documented at the top of mock_nvml.c; only driverVersion, gpu, name, uuid, minor, busId, a GPU's
 * migProfile lines (ID, slices, name) and a MIG device's slot, uuid, profile and instance IDs are read
 * here).
 *
 * make_driver_root (gpudra_operator/localcluster/driverroot.py) installs each tool with the root's
 * inventory appended (the ELF loader ignores trailing bytes): the inventory text, its length as 8
 * little-endian bytes, then the 8 bytes MOCK_TRAILER_MAGIC. So a tool bind-mounted alone into a
 * container still knows the machine. Without a trailer: $GPUDRA_MOCK_NVML_INVENTORY, else
 * <dir of the binary>/../lib/x86_64-linux-gnu/gpudra-mock-nvml.inventory.
 *
 * Also: the binary's own path and driver root (mock_state.h), from /proc/self/exe.
 */
#ifndef GPUDRA_MOCK_INVENTORY_H
#define GPUDRA_MOCK_INVENTORY_H

#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mock_state.h"

#define MOCK_TRAILER_MAGIC "GPUDRAIN"
#define MOCK_MAX_GPUS 64
#define MOCK_MAX_MIGS 256
#define MOCK_MAX_INVENTORY (1 << 20)
#define MOCK_MAX_PROFILES 32

struct mock_gi_profile {
    unsigned int id, slices;
    char name[32]; /* "1g.10gb" */
};

struct mock_gpu {
    int index; /* NVML's: the order in the inventory */
    int minor;
    char name[128];
    char uuid[96];
    char bus_id[32];
    int nprofiles; /* its MIG catalog's GPU instance profiles */
    struct mock_gi_profile profiles[MOCK_MAX_PROFILES];
};

struct mock_mig {
    int parent; /* index of its GPU */
    int slot, gi, ci;
    char uuid[96];
    char profile[32];
};

struct mock_inventory {
    char driver_version[64];
    int ngpus;
    struct mock_gpu gpus[MOCK_MAX_GPUS];
    int nmigs;
    struct mock_mig migs[MOCK_MAX_MIGS];
};

/* The path of the running binary (" (deleted)" dropped when a newer root replaced it); 0 on success. */
static inline int mock_self_exe(char *out, size_t size) {
    ssize_t n = readlink("/proc/self/exe", out, size - 1);
    if (n <= 0) return -1;
    out[n] = '\0';
    const char *deleted = " (deleted)";
    size_t len = (size_t)n, dlen = strlen(deleted);
    if (len > dlen && strcmp(out + len - dlen, deleted) == 0) out[len - dlen] = '\0';
    return 0;
}

/* The state directory of the driver root this binary is installed in (<root>/usr/bin/<tool>);
 * 0, or -1 when the path does not fit. */
static inline int mock_tool_state_dir(char *out, size_t size) {
    char exe[MOCK_PATH_LEN], root[MOCK_PATH_LEN - 32];
    if (mock_self_exe(exe, sizeof exe) != 0) snprintf(exe, sizeof exe, "./tool");
    if (mock_root_of(exe, "/usr/bin", root, sizeof root) != 0) return -1;
    return mock_state_dir(root, out, size);
}

static inline char *mock_read_trailer(void) {
    FILE *f = fopen("/proc/self/exe", "rb");
    if (!f) return NULL;
    char tail[16];
    char *text = NULL;
    if (fseek(f, -16, SEEK_END) == 0 && fread(tail, 1, 16, f) == 16 && memcmp(tail + 8, MOCK_TRAILER_MAGIC, 8) == 0) {
        uint64_t len = 0;
        for (int i = 7; i >= 0; i--) len = (len << 8) | (unsigned char)tail[i];
        if (len > 0 && len < MOCK_MAX_INVENTORY && fseek(f, -16 - (long)len, SEEK_END) == 0) {
            text = calloc(1, len + 1);
            if (text && fread(text, 1, len, f) != len) {
                free(text);
                text = NULL;
            }
        }
    }
    fclose(f);
    return text;
}

static inline char *mock_read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *text = calloc(1, MOCK_MAX_INVENTORY + 1);
    if (text) {
        size_t n = fread(text, 1, MOCK_MAX_INVENTORY, f);
        text[n] = '\0';
    }
    fclose(f);
    return text;
}

/* The inventory text (caller frees), or NULL. */
static inline char *mock_inventory_text(void) {
    char *text = mock_read_trailer();
    if (text) return text;
    const char *env = getenv("GPUDRA_MOCK_NVML_INVENTORY");
    if (env && *env) return mock_read_file(env);
    char exe[MOCK_PATH_LEN];
    if (mock_self_exe(exe, sizeof exe - 64) != 0) return NULL;
    char *slash = strrchr(exe, '/');
    if (!slash) return NULL;
    strcpy(slash, "/../lib/x86_64-linux-gnu/gpudra-mock-nvml.inventory");
    return mock_read_file(exe);
}

static inline void mock_copy_value(char *dst, size_t size, const char *value) {
    snprintf(dst, size, "%s", value);
    size_t len = strlen(dst);
    while (len > 0 && isspace((unsigned char)dst[len - 1])) dst[--len] = '\0';
}

/* Parse `text` (modified in place) into `inv`. */
static inline void mock_parse_inventory(char *text, struct mock_inventory *inv) {
    memset(inv, 0, sizeof *inv);
    struct mock_gpu *current = NULL;
    struct mock_mig *mig = NULL;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        while (isspace((unsigned char)*line)) line++;
        if (*line == '#' || *line == '\0') continue;
        char *value = line + strcspn(line, " \t");
        if (*value) *value++ = '\0';
        while (isspace((unsigned char)*value)) value++;
        if (strcmp(line, "driverVersion") == 0) {
            mock_copy_value(inv->driver_version, sizeof inv->driver_version, value);
        } else if (strcmp(line, "gpu") == 0) {
            current = inv->ngpus < MOCK_MAX_GPUS ? &inv->gpus[inv->ngpus] : NULL;
            if (current) {
                current->index = inv->ngpus++;
                current->minor = -1;
            }
            mig = NULL;
        } else if (strcmp(line, "mig") == 0) {
            /* the keys that follow describe a MIG device of the current GPU, not the GPU */
            mig = current && inv->nmigs < MOCK_MAX_MIGS ? &inv->migs[inv->nmigs++] : NULL;
            if (mig) {
                mig->parent = current->index;
                mig->slot = atoi(value);
            } else current = NULL; /* no room: ignore this device's keys */
        } else if (mig) {
            if (strcmp(line, "uuid") == 0) mock_copy_value(mig->uuid, sizeof mig->uuid, value);
            else if (strcmp(line, "profile") == 0) mock_copy_value(mig->profile, sizeof mig->profile, value);
            else if (strcmp(line, "gpuInstanceId") == 0) mig->gi = atoi(value);
            else if (strcmp(line, "computeInstanceId") == 0) mig->ci = atoi(value);
        } else if (current && strcmp(line, "migProfile") == 0 && current->nprofiles < MOCK_MAX_PROFILES) {
            struct mock_gi_profile *p = &current->profiles[current->nprofiles];
            if (sscanf(value, "%*u %u %u %*u %*u %*u %*u %*u %*u %*u %*u %31s", &p->id, &p->slices, p->name) == 3)
                current->nprofiles++;
        } else if (current && strcmp(line, "name") == 0) {
            mock_copy_value(current->name, sizeof current->name, value);
        } else if (current && strcmp(line, "uuid") == 0) {
            mock_copy_value(current->uuid, sizeof current->uuid, value);
        } else if (current && strcmp(line, "minor") == 0) {
            current->minor = atoi(value);
        } else if (current && strcmp(line, "busId") == 0) {
            mock_copy_value(current->bus_id, sizeof current->bus_id, value);
        }
    }
}

/* Load the inventory into `inv`; 0 on success, -1 when there is none. */
static inline int mock_load_inventory(struct mock_inventory *inv) {
    char *text = mock_inventory_text();
    if (!text) return -1;
    mock_parse_inventory(text, inv);
    free(text);
    return 0;
}

/* The GPU `id` names: its index (decimal) or its UUID. NULL if none. */
static inline const struct mock_gpu *mock_find_gpu(const struct mock_inventory *inv, const char *id) {
    if (*id && strspn(id, "0123456789") == strlen(id)) {
        long index = strtol(id, NULL, 10);
        return index >= 0 && index < inv->ngpus ? &inv->gpus[index] : NULL;
    }
    for (int i = 0; i < inv->ngpus; i++)
        if (strcmp(inv->gpus[i].uuid, id) == 0) return &inv->gpus[i];
    return NULL;
}

static inline const struct mock_mig *mock_find_mig(const struct mock_inventory *inv, const char *uuid) {
    for (int i = 0; i < inv->nmigs; i++)
        if (strcmp(inv->migs[i].uuid, uuid) == 0) return &inv->migs[i];
    return NULL;
}

#endif
