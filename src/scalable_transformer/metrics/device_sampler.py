"""Device telemetry sampled in a background thread: what each device did while training ran.

Every `period` seconds (default 0.5 s) the sampler reads
  NVIDIA (nvidia-ml-py / pynvml)  utilisation, power draw and enforced limit, the total-energy counter,
                                  device memory used/total (what nvidia-smi shows), SM clock, clock-event
                                  (throttle) reasons
  AMD (amdsmi, when importable)   GFX activity, socket power and limit, energy counter, VRAM used/total
  CPU (psutil, always)            this process's utilisation (of the CPUs it may run on) and the system's;
                                  RAPL package energy from /sys/class/powercap when the files are readable
Only cheap per-device queries: never process lists (NVML's process queries take milliseconds).
A field that cannot be read is None with the reason said once (`reasons`), never an invented value;
a reading that fails mid-run is reported, never fatal.

The NVML and amdsmi adapters are thin and are the only parts not exercised by the test suite (no GPU
in CI): each call is one library function, guarded.

Units are in the names: `_util` fractions (0..1), `_w` watts, `_j` joules, `_bytes`, `_mhz`.
"""

from __future__ import annotations

import glob
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

GPU_FIELDS = (
    "device_util",
    "device_power_w",
    "device_power_limit_w",
    "device_memory_used_bytes",
    "device_memory_total_bytes",
    "device_sm_clock_mhz",
)
CPU_FIELDS = ("cpu_process_util", "cpu_system_util", "cpu_power_w")
# NVML clock-event reason bits (nvml.h nvmlClocksEventReason*), named as nvidia-smi -q names them
CLOCK_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


@dataclass
class Reading:
    """One sample: instantaneous values plus cumulative energy counters (joules, None if unknown)."""

    time: float
    values: dict[str, float | None] = field(default_factory=dict)
    device_energy_j: float | None = None
    cpu_energy_j: float | None = None
    clock_reasons: int = 0


# ---------------------------------------------------------------- adapters


class NvmlDevice:
    """One NVIDIA GPU through NVML (nvidia-ml-py). Raises on construction when NVML is unusable."""

    name = "nvml"

    def __init__(self, index: int) -> None:
        import pynvml  # optional dependency (the gpu extra); the sampler falls back without it

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def read(self, r: Reading) -> None:
        n, h = self.nvml, self.handle
        r.values["device_util"] = n.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
        r.values["device_power_w"] = n.nvmlDeviceGetPowerUsage(h) / 1000.0  # mW
        r.values["device_power_limit_w"] = n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
        memory = n.nvmlDeviceGetMemoryInfo(h)  # the figures nvidia-smi prints
        r.values["device_memory_used_bytes"] = float(memory.used)
        r.values["device_memory_total_bytes"] = float(memory.total)
        r.values["device_sm_clock_mhz"] = float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))
        try:
            r.device_energy_j = n.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0  # mJ since driver load
        except n.NVMLError:  # before Volta
            r.device_energy_j = None
        reasons = (
            getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or n.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        r.clock_reasons = int(reasons(h))


class AmdDevice:
    """One AMD GPU through amdsmi (ROCm). Raises on construction when amdsmi is unusable."""

    name = "amdsmi"

    def __init__(self, index: int) -> None:
        import amdsmi  # optional: ships with ROCm only

        amdsmi.amdsmi_init()
        self.smi = amdsmi
        self.handle = amdsmi.amdsmi_get_processor_handles()[index]

    def read(self, r: Reading) -> None:
        s, h = self.smi, self.handle
        r.values["device_util"] = s.amdsmi_get_gpu_activity(h)["gfx_activity"] / 100.0
        power = s.amdsmi_get_power_info(h)  # W on Linux; unsupported fields are "N/A"

        def number(*keys: str) -> float | None:
            for key in keys:
                value = power.get(key)
                if isinstance(value, int | float):
                    return float(value)
            return None

        # MI300+ report current_socket_power, Navi and MI200 average_socket_power (amdsmi.h)
        r.values["device_power_w"] = number("socket_power", "current_socket_power", "average_socket_power")
        limit = number("power_limit")
        # W in amdsmi 6.x-7.1; one 7.x preview documents uW: no GPU draws 100 kW
        r.values["device_power_limit_w"] = None if limit is None else limit / 1e6 if limit > 1e5 else limit
        vram = s.amdsmi_get_gpu_vram_usage(h)  # MB
        r.values["device_memory_used_bytes"] = float(vram["vram_used"]) * 2**20
        r.values["device_memory_total_bytes"] = float(vram["vram_total"]) * 2**20
        energy = s.amdsmi_get_energy_count(h)
        counter = energy.get("energy_accumulator", energy.get("power"))
        r.device_energy_j = float(counter) * float(energy["counter_resolution"]) / 1e6  # uJ units


def open_gpu(device_type: str, index: int) -> tuple[Any, str | None]:
    """(adapter, None) or (None, why there are no GPU figures)."""
    if device_type != "cuda":
        return None, "no GPU: the run is on the CPU"
    errors = []
    for cls, package in ((NvmlDevice, "nvidia-ml-py"), (AmdDevice, "amdsmi")):
        try:
            return cls(index), None
        except ImportError:
            errors.append(f"{package} not installed")
        except Exception as e:  # a library present without its driver
            errors.append(f"{package}: {type(e).__name__}: {e}")
    return None, "no GPU telemetry (" + "; ".join(errors) + "); pip install nvidia-ml-py for NVIDIA GPUs"


class Rapl:
    """CPU package energy from the Linux powercap (RAPL) counters, summed over packages."""

    def __init__(self, root: str = "/sys/class/powercap") -> None:
        self.reason: str | None = None
        self.domains: list[tuple[str, float]] = []  # (energy_uj path, wrap-around range in uJ)
        if not os.path.isdir(root):
            self.reason = f"no RAPL energy: {root} does not exist (not exposed on this machine or VM)"
            return
        paths = sorted(
            p for p in glob.glob(os.path.join(root, "intel-rapl:*")) if p.count(":") == 1
        )  # packages, not their core/uncore subdomains (which they include)
        if not paths:
            self.reason = f"no RAPL energy: {root} has no intel-rapl package domain"
            return
        for path in paths:
            energy = os.path.join(path, "energy_uj")
            try:
                with open(energy) as f:
                    float(f.read())
                with open(os.path.join(path, "max_energy_range_uj")) as f:
                    wrap = float(f.read())
            except OSError as e:  # since Linux 5.10 energy_uj is root-only (CVE-2020-8694)
                self.reason = f"no RAPL energy: cannot read {energy} ({e.strerror})"
                self.domains = []
                return
            self.domains.append((energy, wrap))
        self._last: list[float] | None = None
        self._total = 0.0

    def read_j(self) -> float | None:
        """Joules since the first read (wrap-arounds of each counter unfolded)."""
        if not self.domains:
            return None
        now = []
        for path, _ in self.domains:
            with open(path) as f:
                now.append(float(f.read()))
        if self._last is not None:
            for (_, wrap), before, after in zip(self.domains, self._last, now, strict=True):
                self._total += (after - before) if after >= before else (after + wrap - before)
        self._last = now
        return self._total / 1e6


class CpuProbe:
    """This process's and the system's CPU utilisation (psutil), as fractions of the CPUs."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        try:
            self.cpus = len(self.process.cpu_affinity() or []) or psutil.cpu_count() or 1
        except (AttributeError, psutil.Error):  # no affinity on macOS
            self.cpus = psutil.cpu_count() or 1
        self.process.cpu_percent(None)  # the first call starts the measuring window
        psutil.cpu_percent(None)

    def read(self, r: Reading) -> None:
        r.values["cpu_process_util"] = self.process.cpu_percent(None) / 100.0 / self.cpus
        r.values["cpu_system_util"] = psutil.cpu_percent(None) / 100.0


# ---------------------------------------------------------------- the sampler


class Telemetry:
    """Samples in a daemon thread from `start()` to `stop()`; `interval()` summarises and clears the
    samples since its last call (one log interval)."""

    def __init__(
        self,
        device_type: str = "cpu",
        device_index: int = 0,
        period: float = 0.5,
        gpu: Any = None,
        rapl: Rapl | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.period, self.clock = period, clock
        self.reasons: dict[str, str] = {}  # field group -> why it is None (said once)
        if gpu is None:
            gpu, reason = open_gpu(device_type, device_index)
            if reason:
                self.reasons["gpu"] = reason
        self.gpu = gpu
        self.source = "cpu" if gpu is None else gpu.name
        self.rapl = rapl if rapl is not None else Rapl()
        if self.rapl.reason:
            self.reasons["cpu_energy"] = self.rapl.reason
        self.cpu = CpuProbe()
        self._lock = threading.Lock()
        self._samples: list[Reading] = []
        self._last: Reading | None = None  # the last sample of the previous interval (energy baseline)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    def sample(self) -> Reading:
        """Read every source once (also what the thread does each period)."""
        r = Reading(time=self.clock())
        self.cpu.read(r)
        if self.gpu is not None:
            try:
                self.gpu.read(r)
            except Exception as e:  # a measuring problem is reported, never fatal
                self._error(f"{self.source} read failed: {type(e).__name__}: {e}")
        if self.rapl.domains:
            try:
                r.cpu_energy_j = self.rapl.read_j()
            except OSError as e:
                self._error(f"RAPL read failed: {e}")
        with self._lock:
            self._samples.append(r)
        return r

    def _error(self, text: str) -> None:
        if text not in self.errors:
            self.errors.append(text)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def start(self) -> Telemetry:
        self._last = self.sample()
        with self._lock:
            self._samples = []
        self._thread = threading.Thread(target=self._run, name="stx-telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.period + 1)

    def interval(self) -> dict[str, Any]:
        """Means over the samples since the last call (memory: the largest), energy as the counter
        difference (joules) and mean power from it; None where nothing was measured."""
        last = self.sample()  # closes the interval exactly now
        with self._lock:
            samples, self._samples = self._samples, []
        first, self._last = self._last, last
        out: dict[str, Any] = {}
        for key in (*GPU_FIELDS, "cpu_process_util", "cpu_system_util"):
            values = [s.values[key] for s in samples if s.values.get(key) is not None]
            if key in ("device_memory_used_bytes", "device_memory_total_bytes"):
                out[key] = max(values) if values else None  # type: ignore[type-var]
            else:
                out[key] = statistics.fmean(values) if values else None  # type: ignore[arg-type]
        seconds = last.time - first.time if first is not None else 0.0
        for name in ("device_energy_j", "cpu_energy_j"):
            a = getattr(first, name) if first is not None else None
            b = getattr(last, name)
            out[name] = None if a is None or b is None else b - a
        out["cpu_power_w"] = out["cpu_energy_j"] / seconds if out["cpu_energy_j"] and seconds > 0 else None
        reasons = 0
        for s in samples:
            reasons |= s.clock_reasons
        out["device_clock_event_reasons"] = (
            ",".join(name for bit, name in CLOCK_REASONS.items() if reasons & bit) if self.gpu else None
        )
        return out


def short(record: dict[str, Any]) -> str:
    """The compact console part: 'GPU 79% 140/400 W 34.6/39.6 GiB' or 'CPU 97% (system 99%)'."""
    parts = []
    if record.get("device_util") is not None:
        text = f"GPU {100 * record['device_util']:.0f}%"
        if record.get("device_power_w") is not None and record.get("device_power_limit_w"):
            text += f" {record['device_power_w']:.0f}/{record['device_power_limit_w']:.0f} W"
        if record.get("device_memory_used_bytes") and record.get("device_memory_total_bytes"):
            text += (
                f" {record['device_memory_used_bytes'] / 2**30:.1f}/"
                f"{record['device_memory_total_bytes'] / 2**30:.1f} GiB"
            )
        parts.append(text)
    if record.get("cpu_process_util") is not None:
        text = f"CPU {100 * record['cpu_process_util']:.0f}%"
        if record.get("cpu_system_util") is not None:
            text += f" (system {100 * record['cpu_system_util']:.0f}%)"
        if record.get("cpu_power_w") is not None:
            text += f" {record['cpu_power_w']:.0f} W"
        parts.append(text)
    return ", ".join(parts)
