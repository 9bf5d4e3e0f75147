/*
 * gpudra mock NVML: the NVML types and constants the mock needs, written from the NVML API
 * reference and the ctypes definitions of nvidia-ml-py (pynvml). Not NVIDIA's nvml.h.
 *
 * Only the layouts the mock fills are defined; each mirrors a pynvml ctypes structure:
 *   mock_pci_info_t       <-> pynvml.nvmlPciInfo_t        (nvmlDeviceGetPciInfo_v3)
 *   mock_pci_info_v2_t    <-> pynvml.nvmlPciInfo_v2_t     (nvmlDeviceGetPciInfo, _v2)
 *   mock_memory_t         <-> pynvml.c_nvmlMemory_t       (nvmlDeviceGetMemoryInfo)
 *   mock_memory_v2_t      <-> pynvml.c_nvmlMemory_v2_t    (nvmlDeviceGetMemoryInfo_v2)
 *   mock_device_attrs_t   <-> pynvml.c_nvmlDeviceAttributes (nvmlDeviceGetAttributes_v2)
 *   mock_gpu_instance_profile_info_t / _v2_t <-> pynvml.c_nvmlGpuInstanceProfileInfo_t / _v2_t
 *   mock_placement_t      <-> pynvml.c_nvmlGpuInstancePlacement_t (and c_nvmlComputeInstancePlacement_t)
 *   mock_compute_instance_profile_info_t / _v2_t <-> pynvml.c_nvmlComputeInstanceProfileInfo_t / _v2_t
 *   mock_event_data_t     <-> pynvml.c_nvmlEventData_t     (nvmlEventSetWait_v2)
 *   mock_field_value_t    <-> pynvml.c_nvmlFieldValue_t    (nvmlDeviceGetFieldValues)
 */
#ifndef GPUDRA_MOCK_NVML_H
#define GPUDRA_MOCK_NVML_H

/* nvmlReturn_t */
typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NO_PERMISSION 4
#define NVML_ERROR_ALREADY_INITIALIZED 5
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_INSUFFICIENT_POWER 8
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_IRQ_ISSUE 11
#define NVML_ERROR_LIBRARY_NOT_FOUND 12
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_ERROR_CORRUPTED_INFOROM 14
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_RESET_REQUIRED 16
#define NVML_ERROR_OPERATING_SYSTEM 17
#define NVML_ERROR_LIB_RM_VERSION_MISMATCH 18
#define NVML_ERROR_IN_USE 19
#define NVML_ERROR_MEMORY 20
#define NVML_ERROR_NO_DATA 21
#define NVML_ERROR_VGPU_ECC_NOT_SUPPORTED 22
#define NVML_ERROR_INSUFFICIENT_RESOURCES 23
#define NVML_ERROR_FREQ_NOT_SUPPORTED 24
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_DEPRECATED 26
#define NVML_ERROR_NOT_READY 27
#define NVML_ERROR_GPU_NOT_FOUND 28
#define NVML_ERROR_INVALID_STATE 29
#define NVML_ERROR_UNKNOWN 999

/* nvmlComputeMode_t */
#define NVML_COMPUTEMODE_DEFAULT 0
#define NVML_COMPUTEMODE_EXCLUSIVE_THREAD 1 /* support removed from NVML */
#define NVML_COMPUTEMODE_PROHIBITED 2
#define NVML_COMPUTEMODE_EXCLUSIVE_PROCESS 3

#define NVML_DEVICE_MIG_DISABLE 0
#define NVML_DEVICE_MIG_ENABLE 1

/* Buffer sizes (bytes, NUL included) as the API reference gives them. */
#define MOCK_PCI_BUS_ID_SIZE 32        /* NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE */
#define MOCK_PCI_BUS_ID_LEGACY_SIZE 16 /* NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE */

/* Version word of a versioned struct: sizeof(struct) | (version << 24). */
#define MOCK_STRUCT_VERSION(size, ver) ((unsigned int)(size) | ((unsigned int)(ver) << 24))

typedef struct {
    char busIdLegacy[MOCK_PCI_BUS_ID_LEGACY_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[MOCK_PCI_BUS_ID_SIZE];
} mock_pci_info_t;

typedef struct {
    char busId[MOCK_PCI_BUS_ID_LEGACY_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    unsigned int reserved0;
    unsigned int reserved1;
    unsigned int reserved2;
    unsigned int reserved3;
} mock_pci_info_v2_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} mock_memory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} mock_memory_v2_t;

#define MOCK_MEMORY_V2 MOCK_STRUCT_VERSION(sizeof(mock_memory_v2_t), 2) /* 0x02000028 */

typedef struct {
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    unsigned int gpuInstanceSliceCount;
    unsigned int computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} mock_device_attrs_t;

/* MIG GPU/compute instances (what go-nvlib's MigDevice.GetProfile, used by nvidia-ctk, asks). */
typedef struct {
    unsigned int start;
    unsigned int size;
} mock_placement_t;

typedef struct {
    void *device;
    unsigned int id;
    unsigned int profileId;
    mock_placement_t placement;
} mock_gpu_instance_info_t;

typedef struct {
    void *device;
    void *gpuInstance;
    unsigned int id;
    unsigned int profileId;
    mock_placement_t placement;
} mock_compute_instance_info_t;

typedef struct {
    unsigned int id;
    unsigned int isP2pSupported;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
} mock_gpu_instance_profile_info_t;

#define MOCK_GPU_INSTANCE_PROFILE_COUNT 0x12 /* NVML_GPU_INSTANCE_PROFILE_COUNT */
#define MOCK_DEVICE_NAME_V2_SIZE 96          /* NVML_DEVICE_NAME_V2_BUFFER_SIZE */

/* <-> pynvml.c_nvmlGpuInstanceProfileInfo_v2_t (nvmlDeviceGetGpuInstanceProfileInfoV, ...ByIdV) */
typedef struct {
    unsigned int version;
    unsigned int id;
    unsigned int isP2pSupported;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
    char name[MOCK_DEVICE_NAME_V2_SIZE];
} mock_gpu_instance_profile_info_v2_t;

/* nvmlGpuInstanceProfileInfo_v3_t (go-nvml's GetGpuInstanceProfileInfoV().V3()): isP2pSupported gone,
 * capabilities (NVML_GPU_INSTANCE_PROFILE_CAPS_*) at the end. */
typedef struct {
    unsigned int version;
    unsigned int id;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
    char name[MOCK_DEVICE_NAME_V2_SIZE];
    unsigned int capabilities;
} mock_gpu_instance_profile_info_v3_t;

#define MOCK_GPU_INSTANCE_PROFILE_INFO_V2 MOCK_STRUCT_VERSION(sizeof(mock_gpu_instance_profile_info_v2_t), 2) /* 0x02000098 */
#define MOCK_GPU_INSTANCE_PROFILE_INFO_V3 MOCK_STRUCT_VERSION(sizeof(mock_gpu_instance_profile_info_v3_t), 3) /* 0x03000098 */

typedef struct {
    unsigned int id;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
} mock_compute_instance_profile_info_t;

/* <-> pynvml.c_nvmlComputeInstanceProfileInfo_v2_t (nvmlGpuInstanceGetComputeInstanceProfileInfoV) */
typedef struct {
    unsigned int version;
    unsigned int id;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    char name[MOCK_DEVICE_NAME_V2_SIZE];
} mock_compute_instance_profile_info_v2_t;

/* nvmlComputeInstanceProfileInfo_v3_t (nvml.h): v2 plus capabilities (NVML_COMPUTE_INSTANCE_PROFILE_CAPS_*) */
typedef struct {
    mock_compute_instance_profile_info_v2_t v2;
    unsigned int capabilities;
} mock_compute_instance_profile_info_v3_t;

#define MOCK_COMPUTE_INSTANCE_PROFILE_INFO_V2 \
    MOCK_STRUCT_VERSION(sizeof(mock_compute_instance_profile_info_v2_t), 2) /* 0x02000088 */
#define MOCK_COMPUTE_INSTANCE_PROFILE_INFO_V3 \
    MOCK_STRUCT_VERSION(sizeof(mock_compute_instance_profile_info_v3_t), 3) /* 0x0300008C */
#define MOCK_COMPUTE_INSTANCE_PROFILE_COUNT 0x9 /* NVML_COMPUTE_INSTANCE_PROFILE_COUNT */
#define MOCK_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT 0x1 /* NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT */

/* Events (nvmlEventSetWait_v2) <-> pynvml.c_nvmlEventData_t */
#define MOCK_EVENT_SINGLE_BIT_ECC 0x1ULL /* nvmlEventTypeSingleBitEccError */
#define MOCK_EVENT_DOUBLE_BIT_ECC 0x2ULL /* nvmlEventTypeDoubleBitEccError */
#define MOCK_EVENT_XID 0x8ULL            /* nvmlEventTypeXidCriticalError */
#define MOCK_EVENT_SUPPORTED (MOCK_EVENT_SINGLE_BIT_ECC | MOCK_EVENT_DOUBLE_BIT_ECC | MOCK_EVENT_XID)
#define MOCK_NO_INSTANCE 0xFFFFFFFFu /* gpuInstanceId/computeInstanceId of an event not tied to a MIG device */

typedef struct {
    void *device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} mock_event_data_t;

/* Field values (nvmlDeviceGetFieldValues) <-> pynvml.c_nvmlFieldValue_t */
#define MOCK_FI_DEV_GET_GPU_RECOVERY_ACTION 230 /* NVML_FI_DEV_GET_GPU_RECOVERY_ACTION */
#define MOCK_VALUE_TYPE_UNSIGNED_INT 1

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    unsigned int valueType;
    unsigned int nvmlReturn;
    union {
        double dVal;
        unsigned int uiVal;
        unsigned long ulVal;
        unsigned long long ullVal;
        long long sllVal;
        int siVal;
        unsigned short usVal;
    } value;
} mock_field_value_t;

#endif
