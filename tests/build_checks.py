"""What the build should have found on this machine, checked the way CMakeLists.txt checks it.
Standard library only (test_build runs it in an interpreter without site-packages)."""

import importlib.util
import os


def nvshmem_wheel_home(module: str = "nvidia.nvshmem"):
    """The nvidia-nvshmem wheel's directory when it has what CMakeLists.txt builds against
    (include/nvshmem.h, lib/libnvshmem_device.a, lib/libnvshmem_host.so.3), else None. Never
    raises: `find_spec("nvidia.nvshmem")` raises ModuleNotFoundError when the `nvidia` namespace
    package itself is absent (a machine with nvcc but no NVIDIA wheels), which used to stop the
    collection of the whole test suite."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    locations = list(getattr(spec, "submodule_search_locations", None) or []) if spec is not None else []
    for home in locations:
        if all(os.path.exists(os.path.join(home, f)) for f in
               ("include/nvshmem.h", "lib/libnvshmem_device.a", "lib/libnvshmem_host.so.3")):
            return home
    return None
