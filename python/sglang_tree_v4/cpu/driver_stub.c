/* Stand-in for the NVIDIA driver library (libcuda.so.1) on machines without one.
 *
 * PyPI's sgl_kernel is a CUDA build whose extension module links against libcuda.so.1, so it
 * cannot even be imported on a plain CPU, although SGLang's CPU engine only needs its Python
 * wrappers. This library provides the few driver entry points that are resolved at load time;
 * every one of them answers CUDA_ERROR_NO_DEVICE (100), so nothing can mistake the machine for
 * one with a GPU.
 */
#define NO_DEVICE 100

int cuInit(unsigned int flags) { (void)flags; return NO_DEVICE; }

int cuDriverGetVersion(int *version) {
    if (version) *version = 0;
    return NO_DEVICE;
}

int cuDeviceGetCount(int *count) {
    if (count) *count = 0;
    return NO_DEVICE;
}

int cuPointerGetAttribute(void *data, int attribute, unsigned long long pointer) {
    (void)data; (void)attribute; (void)pointer;
    return NO_DEVICE;
}

int cuGetProcAddress(const char *symbol, void **fn, int version, unsigned long long flags) {
    (void)symbol; (void)version; (void)flags;
    if (fn) *fn = 0;
    return NO_DEVICE;
}
