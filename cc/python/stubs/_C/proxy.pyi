"""where a GPU's proxy thread runs (cc/proxy/topology.h)"""

from collections.abc import Sequence


def parse_cpulist(text: str) -> list[int]:
    """CPUs of a Linux cpulist such as '0-3,8'; [] if malformed."""

def cpu_near_device(sysfs_root: str, bus_id: str, local_index: int, allowed: Sequence[int]) -> int:
    """
    The proxy CPU of local rank `local_index` for the GPU at PCI `bus_id`: from the device's local_cpulist under sysfs_root, within `allowed` ([] = any), counting down; -1 if unknown.
    """

def allowed_cpus() -> list[int]:
    """The CPUs this process may run on."""

def gdrcopy_status(mode: str | None = None, library: str | None = None, device: str | None = None) -> tuple[bool, str]:
    """
    (available, reason) of GDRCopy for the proxy's flags: the driver node, the library (dlopen), gdr_open; no GPU needed. reason is 'gdrcopy' when available.
    """

def gdrcopy_select(mode: str | None = None, library: str | None = None, device: str | None = None) -> str:
    """
    The flag path the cuda backend would choose before touching the GPU: 'gdrcopy' or 'mapped-host: <reason>'; raises RuntimeError when mode '1' requires GDRCopy and it is unavailable.
    """

def local_process_rank() -> int:
    """
    This process's rank on its node (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, LOCAL_RANK), else 0.
    """
