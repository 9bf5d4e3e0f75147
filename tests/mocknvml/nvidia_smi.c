/*
 * gpudra mock nvidia-smi: what a container given a claim's GPU by CDI runs to see which GPUs it has.
 *
 * Built STATIC by `make mock-nvidia-smi` (build/mock-nvml/nvidia-smi): CDI bind-mounts the driver
 * root's usr/bin/nvidia-smi into containers whose images have no libc of the host (the e2e test's
 * busybox image), so it must need nothing but the kernel. It does not load NVML either.
 *
 * make_driver_root (gpudra_operator/localcluster/driverroot.py) installs it as
 * <root>/usr/bin/nvidia-smi with the root's mock-NVML inventory appended (the ELF loader ignores
 * trailing bytes): the inventory text, its length as 8 little-endian bytes, then the 8 bytes
 * TRAILER_MAGIC. So the single bind-mounted file knows the driver version and each GPU's minor,
 * name and UUID. Without a trailer it reads $GPUDRA_MOCK_NVML_INVENTORY, else
 * <dir of this binary>/../lib/x86_64-linux-gnu/gpudra-mock-nvml.inventory (format: the header of
 * mock_nvml.c; only driverVersion, gpu, name, uuid, minor and mig are read).
 *
 * The GPUs it reports are those whose /dev/nvidia<minor> node exists (in the container: the ones
 * CDI injected), in minor order, like `nvidia-smi -L`:
 *
 *   gpudra mock nvidia-smi: driver 570.133.20, GPUs: GPU-aaaa GPU-bbbb
 *   GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa) /dev/nvidia3
 *
 * Exit status 0 with at least one GPU; 9 (the real tool's "couldn't communicate with the NVIDIA
 * driver") with none or without an inventory. `--version` prints the driver version only.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TRAILER_MAGIC "GPUDRAIN"
#define MAX_GPUS 64
#define MAX_INVENTORY (1 << 20)

struct gpu {
    int minor;
    char name[128];
    char uuid[96];
};

static struct gpu gpus[MAX_GPUS];
static int ngpus;
static char driver_version[64];

static char *read_trailer(void) {
    FILE *f = fopen("/proc/self/exe", "rb");
    if (!f)
        return NULL;
    char tail[16];
    char *text = NULL;
    if (fseek(f, -16, SEEK_END) == 0 && fread(tail, 1, 16, f) == 16 && memcmp(tail + 8, TRAILER_MAGIC, 8) == 0) {
        uint64_t len = 0;
        for (int i = 7; i >= 0; i--)
            len = (len << 8) | (unsigned char)tail[i];
        if (len > 0 && len < MAX_INVENTORY && fseek(f, -16 - (long)len, SEEK_END) == 0) {
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

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *text = calloc(1, MAX_INVENTORY + 1);
    if (text) {
        size_t n = fread(text, 1, MAX_INVENTORY, f);
        text[n] = '\0';
    }
    fclose(f);
    return text;
}

static char *inventory(void) {
    char *text = read_trailer();
    if (text)
        return text;
    const char *env = getenv("GPUDRA_MOCK_NVML_INVENTORY");
    if (env && *env)
        return read_file(env);
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 64);
    if (n <= 0)
        return NULL;
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (!slash)
        return NULL;
    strcpy(slash, "/../lib/x86_64-linux-gnu/gpudra-mock-nvml.inventory");
    return read_file(exe);
}

static void copy_value(char *dst, size_t size, const char *value) {
    snprintf(dst, size, "%s", value);
    size_t len = strlen(dst);
    while (len > 0 && isspace((unsigned char)dst[len - 1]))
        dst[--len] = '\0';
}

static void parse(char *text) {
    struct gpu *current = NULL;
    int in_mig = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        while (isspace((unsigned char)*line))
            line++;
        if (*line == '#' || *line == '\0')
            continue;
        char *value = line + strcspn(line, " \t");
        if (*value)
            *value++ = '\0';
        while (isspace((unsigned char)*value))
            value++;
        if (strcmp(line, "driverVersion") == 0) {
            copy_value(driver_version, sizeof driver_version, value);
        } else if (strcmp(line, "gpu") == 0) {
            current = ngpus < MAX_GPUS ? &gpus[ngpus++] : NULL;
            if (current)
                current->minor = -1;
            in_mig = 0;
        } else if (strcmp(line, "mig") == 0) {
            in_mig = 1;  /* the keys that follow describe a MIG device, not the GPU */
        } else if (current && !in_mig && strcmp(line, "name") == 0) {
            copy_value(current->name, sizeof current->name, value);
        } else if (current && !in_mig && strcmp(line, "uuid") == 0) {
            copy_value(current->uuid, sizeof current->uuid, value);
        } else if (current && !in_mig && strcmp(line, "minor") == 0) {
            current->minor = atoi(value);
        }
    }
}

static int present_minors(int *minors, int max) {
    DIR *dev = opendir("/dev");
    if (!dev)
        return 0;
    int n = 0;
    struct dirent *entry;
    while ((entry = readdir(dev)) && n < max) {
        const char *digits = entry->d_name + strlen("nvidia");
        if (strncmp(entry->d_name, "nvidia", 6) != 0 || !*digits || strspn(digits, "0123456789") != strlen(digits))
            continue;
        char path[300];
        struct stat st;
        snprintf(path, sizeof path, "/dev/%s", entry->d_name);
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
    char *text = inventory();
    if (!text) {
        fprintf(stderr, "gpudra mock nvidia-smi: no inventory (no trailer, no $GPUDRA_MOCK_NVML_INVENTORY, "
                        "no ../lib/x86_64-linux-gnu/gpudra-mock-nvml.inventory)\n");
        return 9;
    }
    parse(text);
    if (argc > 1 && strcmp(argv[1], "--version") == 0) {
        printf("gpudra mock nvidia-smi\nDRIVER version : %s\n", driver_version);
        return 0;
    }
    int minors[MAX_GPUS];
    int n = present_minors(minors, MAX_GPUS);
    const struct gpu *shown[MAX_GPUS];
    int nshown = 0;
    for (int i = 0; i < n; i++)
        for (int g = 0; g < ngpus; g++)
            if (gpus[g].minor == minors[i])
                shown[nshown++] = &gpus[g];
    printf("gpudra mock nvidia-smi: driver %s, GPUs:", driver_version);
    for (int i = 0; i < nshown; i++)
        printf(" %s", shown[i]->uuid);
    printf("\n");
    for (int i = 0; i < nshown; i++)
        printf("GPU %d: %s (UUID: %s) /dev/nvidia%d\n", i, shown[i]->name, shown[i]->uuid, shown[i]->minor);
    free(text);
    if (nshown == 0) {
        fprintf(stderr, "NVIDIA-SMI has failed because it couldn't find a GPU device node (/dev/nvidia<minor>)\n");
        return 9;
    }
    return 0;
}
