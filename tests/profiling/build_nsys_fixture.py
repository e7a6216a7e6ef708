"""Build the small Nsight Systems SQLite export the profiling tests read.

    python tests/profiling/build_nsys_fixture.py tests/profiling/fixtures/nsys_small.sqlite

Schema: the tables below have the names, column names, column order and declared types of
an `nsys export --type sqlite` from Nsight Systems 2024.6 (META_DATA_EXPORT says
EXPORT_PRODUCT_VERSION 2024.6.2.225, EXPORT_SCHEMA_VERSION 3.16.1) -- a subset of the
tables a real export holds (no RUNTIME, OSRT, TARGET_INFO_*, ...; nsys creates tables
lazily, so a real export may lack tables too). Written from the export's documented
schema, not copied from a real report; nothing here ran on a GPU.

Columns the reader (`harness.profiling.nsys`) uses:
  StringIds                   id, value
  ENUM_CUDA_MEMCPY_OPER       id, name          (joined by name: CUDA_MEMCPY_KIND_HTOD, ...)
  ENUM_CUDA_MEM_KIND          id, name          (CUDA_MEMOPR_MEMORY_KIND_PINNED, ...)
  ENUM_NSYS_EVENT_TYPE        id, name          (NvtxPushPopRange, NvtxStartEndRange)
  META_DATA_EXPORT            name, value       (logged only)
  CUPTI_ACTIVITY_KIND_MEMCPY  start, end, deviceId, contextId, streamId, correlationId,
                              globalPid, bytes, copyKind, srcKind, dstKind
  CUPTI_ACTIVITY_KIND_KERNEL  start, end, deviceId, contextId, streamId, correlationId,
                              globalPid, shortName, demangledName
  NVTX_EVENTS                 start, end, eventType, text, textId, globalTid, domainId
The other columns are filled with plausible values or NULL where the schema allows.

Enum ids are deliberately NOT nsys's own numbering (nsys 2024.6 has HTOD=1, DTOH=2,
PAGEABLE=0, PINNED=1, NvtxPushPopRange=59, ...): here every id is permuted, so a reader
that hard-codes an id reads the wrong kinds.

The timeline (T0 = 1.5 s into the session; times below in microseconds after T0,
exported as integer nanoseconds):

    copies                                       kernels (stream 7)      NVTX ranges
    C1 H2D pinned   s13 [ 2,  6] 100000 B        K1 [ 1,  3]             moebench:prefill_fresh
    C2 H2D pageable s14 [ 4,  8]  40000 B        K2 [ 5, 10]               push/pop  [ 1, 11]
    C3 H2D pinned   s14 [13, 15]  50000 B        K3 [12, 14]             moebench:decode
    C4 D2H pinned   s13 [16, 17]   8000 B        K4 [14, 16]               start/end [12, 20]
    C5 H2D pinned   s13 [20, 22]  60000 B        K5 [21, 24]               push/pop  [21, 25]
                                                                         warmup:setup
                                                                           push/pop  [-1, -0.5]
plus an NVTX domain-create event and a mark (no end), which are not ranges.
C1 and C2 overlap (two copy streams); C5 straddles the start of the second decode range.
"""
from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "fixtures" / "nsys_small.sqlite"

T0 = 1_500_000_000          # ns: activity starts 1.5 s into the session
PID, TID = 31337, 31337
GLOBAL_PID = PID << 24      # nsys serialises a process GlobalId with the pid in bits 24..55
GLOBAL_TID = GLOBAL_PID + TID

SCHEMA = """
CREATE TABLE StringIds (
    id INTEGER NOT NULL PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE META_DATA_EXPORT (
    name TEXT NOT NULL,
    value TEXT
);
CREATE TABLE ENUM_CUDA_MEMCPY_OPER (
    id INTEGER NOT NULL PRIMARY KEY,
    name TEXT,
    label TEXT
);
CREATE TABLE ENUM_CUDA_MEM_KIND (
    id INTEGER NOT NULL PRIMARY KEY,
    name TEXT,
    label TEXT
);
CREATE TABLE ENUM_NSYS_EVENT_TYPE (
    id INTEGER NOT NULL PRIMARY KEY,
    name TEXT,
    label TEXT
);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (
    start INTEGER NOT NULL,
    end INTEGER NOT NULL,
    deviceId INTEGER NOT NULL,
    contextId INTEGER NOT NULL,
    greenContextId INTEGER,
    streamId INTEGER NOT NULL,
    correlationId INTEGER,
    globalPid INTEGER,
    bytes INTEGER NOT NULL,
    copyKind INTEGER NOT NULL,
    deprecatedSrcId INTEGER,
    srcKind INTEGER,
    dstKind INTEGER,
    srcDeviceId INTEGER,
    srcContextId INTEGER,
    dstDeviceId INTEGER,
    dstContextId INTEGER,
    migrationCause INTEGER,
    graphNodeId INTEGER,
    virtualAddress INTEGER
);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (
    start INTEGER NOT NULL,
    end INTEGER NOT NULL,
    deviceId INTEGER NOT NULL,
    contextId INTEGER NOT NULL,
    greenContextId INTEGER,
    streamId INTEGER NOT NULL,
    correlationId INTEGER,
    globalPid INTEGER,
    demangledName INTEGER NOT NULL,
    shortName INTEGER NOT NULL,
    mangledName INTEGER,
    launchType INTEGER,
    cacheConfig INTEGER,
    registersPerThread INTEGER NOT NULL,
    gridX INTEGER NOT NULL,
    gridY INTEGER NOT NULL,
    gridZ INTEGER NOT NULL,
    blockX INTEGER NOT NULL,
    blockY INTEGER NOT NULL,
    blockZ INTEGER NOT NULL,
    staticSharedMemory INTEGER NOT NULL,
    dynamicSharedMemory INTEGER NOT NULL,
    localMemoryPerThread INTEGER NOT NULL,
    localMemoryTotal INTEGER NOT NULL,
    gridId INTEGER NOT NULL,
    sharedMemoryExecuted INTEGER,
    graphNodeId INTEGER,
    sharedMemoryLimitConfig INTEGER
);
CREATE TABLE NVTX_EVENTS (
    start INTEGER NOT NULL,
    end INTEGER,
    eventType INTEGER NOT NULL,
    rangeId INTEGER,
    category INTEGER,
    color INTEGER,
    text TEXT,
    globalTid INTEGER,
    endGlobalTid INTEGER,
    textId INTEGER,
    domainId INTEGER,
    uint64Value INTEGER,
    int64Value INTEGER,
    doubleValue REAL,
    uint32Value INTEGER,
    int32Value INTEGER,
    floatValue REAL,
    jsonTextId INTEGER,
    jsonText TEXT,
    binaryData TEXT
);
"""

# (nsys 2024.6 id, name, label); the fixture id is 13 - nsys id (reversed order)
_MEMCPY_OPER = [(0, "CUDA_MEMCPY_KIND_UNKNOWN", "Unknown"), (1, "CUDA_MEMCPY_KIND_HTOD", "Host-to-Device"),
                (2, "CUDA_MEMCPY_KIND_DTOH", "Device-to-Host"), (3, "CUDA_MEMCPY_KIND_HTOA", "Host-to-Array"),
                (4, "CUDA_MEMCPY_KIND_ATOH", "Array-to-Host"), (5, "CUDA_MEMCPY_KIND_ATOA", "Array-to-Array"),
                (6, "CUDA_MEMCPY_KIND_ATOD", "Array-to-Device"), (7, "CUDA_MEMCPY_KIND_DTOA", "Device-to-Array"),
                (8, "CUDA_MEMCPY_KIND_DTOD", "Device-to-Device"), (9, "CUDA_MEMCPY_KIND_HTOH", "Host-to-Host"),
                (10, "CUDA_MEMCPY_KIND_PTOP", "Peer-to-Peer"),
                (11, "CUDA_MEMCPY_KIND_UVM_HTOD", "Unified Host-to-Device"),
                (12, "CUDA_MEMCPY_KIND_UVM_DTOH", "Unified Device-to-Host"),
                (13, "CUDA_MEMCPY_KIND_UVM_DTOD", "Unified Device-to-Device")]
# the fixture id is 7 - nsys id: PINNED gets 6, and 1 (nsys's PINNED) is MANAGED_STATIC here
_MEM_KIND = [(0, "CUDA_MEMOPR_MEMORY_KIND_PAGEABLE", "Pageable"), (1, "CUDA_MEMOPR_MEMORY_KIND_PINNED", "Pinned"),
             (2, "CUDA_MEMOPR_MEMORY_KIND_DEVICE", "Device"), (3, "CUDA_MEMOPR_MEMORY_KIND_ARRAY", "Array"),
             (4, "CUDA_MEMOPR_MEMORY_KIND_MANAGED", "Managed"),
             (5, "CUDA_MEMOPR_MEMORY_KIND_DEVICE_STATIC", "Device Static"),
             (6, "CUDA_MEMOPR_MEMORY_KIND_MANAGED_STATIC", "Managed Static"),
             (7, "CUDA_MEMOPR_MEMORY_KIND_UNKNOWN", "Unknown")]
# nsys ids 34/59/60/75, rotated: each name gets the next one's id
_EVENT_TYPE = [(34, "NvtxMark", "NvtxMark"), (59, "NvtxPushPopRange", "NvtxPushPopRange"),
               (60, "NvtxStartEndRange", "NvtxStartEndRange"), (75, "NvtxDomainCreate", "NvtxDomainCreate")]

MEMCPY_IDS = {name: 13 - nsys_id for nsys_id, name, _ in _MEMCPY_OPER}
MEM_KIND_IDS = {name: 7 - nsys_id for nsys_id, name, _ in _MEM_KIND}
EVENT_TYPE_IDS = {name: _EVENT_TYPE[(i + 1) % len(_EVENT_TYPE)][0] for i, (_, name, _) in enumerate(_EVENT_TYPE)}

STRINGS = {
    1: "moebench",
    2: "moebench:prefill_fresh",            # registered NVTX string (textId), not inline text
    3: "ampere_sgemm_64x32_sliced1x4_nn",
    4: "void ampere_sgemm_64x32_sliced1x4_nn(...)",
    5: "vectorized_elementwise_kernel",
    6: "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
       "std::array<char *, 3>>(int, T2, T3)",
    7: "reduce_kernel",
    8: "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
       "unsigned int, long, 4>>(T3)",
}


def us(t: float) -> int:
    """Microseconds after T0 -> exported integer nanoseconds."""
    return T0 + round(t * 1000)


def build(out: str | Path = DEFAULT_OUT) -> Path:
    """Write the fixture to `out` (replacing it) and return its path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    con = sqlite3.connect(out)
    try:
        con.execute("PRAGMA page_size = 1024")   # before the first table: keeps the file a few KB
        con.executescript(SCHEMA)
        con.executemany("INSERT INTO StringIds VALUES (?, ?)", sorted(STRINGS.items()))
        con.executemany("INSERT INTO META_DATA_EXPORT VALUES (?, ?)",
                        [("EXPORT_PRODUCT_VERSION", "2024.6.2.225"), ("EXPORT_SCHEMA_VERSION", "3.16.1"),
                         ("EXPORT_NOTE", "moebench test fixture, hand-built (tests/profiling/build_nsys_fixture.py)")])
        con.executemany("INSERT INTO ENUM_CUDA_MEMCPY_OPER VALUES (?, ?, ?)",
                        sorted((MEMCPY_IDS[n], n, label) for _, n, label in _MEMCPY_OPER))
        con.executemany("INSERT INTO ENUM_CUDA_MEM_KIND VALUES (?, ?, ?)",
                        sorted((MEM_KIND_IDS[n], n, label) for _, n, label in _MEM_KIND))
        con.executemany("INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES (?, ?, ?)",
                        sorted((EVENT_TYPE_IDS[n], n, label) for _, n, label in _EVENT_TYPE))

        htod, dtoh = MEMCPY_IDS["CUDA_MEMCPY_KIND_HTOD"], MEMCPY_IDS["CUDA_MEMCPY_KIND_DTOH"]
        pinned = MEM_KIND_IDS["CUDA_MEMOPR_MEMORY_KIND_PINNED"]
        pageable = MEM_KIND_IDS["CUDA_MEMOPR_MEMORY_KIND_PAGEABLE"]
        device = MEM_KIND_IDS["CUDA_MEMOPR_MEMORY_KIND_DEVICE"]
        # (start us, end us, stream, correlationId, bytes, copyKind, srcKind, dstKind)
        copies = [(2, 6, 13, 102, 100_000, htod, pinned, device),       # C1
                  (4, 8, 14, 103, 40_000, htod, pageable, device),      # C2
                  (13, 15, 14, 106, 50_000, htod, pinned, device),      # C3
                  (16, 17, 13, 109, 8_000, dtoh, device, pinned),       # C4
                  (20, 22, 13, 110, 60_000, htod, pinned, device)]      # C5
        con.executemany(
            "INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            [(us(s), us(e), 0, 1, None, stream, corr, GLOBAL_PID, nbytes, kind, None, src, dst,
              None, None, None, None, None, None, None)
             for s, e, stream, corr, nbytes, kind, src, dst in copies])
        # (start us, end us, correlationId, shortName, demangledName, gridX, blockX, gridId)
        kernels = [(1, 3, 101, 3, 4, 64, 128, 11),     # K1
                   (5, 10, 104, 3, 4, 256, 128, 12),   # K2
                   (12, 14, 105, 5, 6, 32, 128, 13),   # K3
                   (14, 16, 107, 5, 6, 32, 128, 14),   # K4 (touches K3)
                   (21, 24, 111, 7, 8, 1, 512, 15)]    # K5
        con.executemany(
            "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            [(us(s), us(e), 0, 1, None, 7, corr, GLOBAL_PID, demangled, short, None, None, None,
              32, grid, 1, 1, block, 1, 1, 0, 0, 0, 0, grid_id, 0, None, None)
             for s, e, corr, short, demangled, grid, block, grid_id in kernels])
        push_pop, start_end = EVENT_TYPE_IDS["NvtxPushPopRange"], EVENT_TYPE_IDS["NvtxStartEndRange"]
        # (start, end, eventType, rangeId, text, endGlobalTid, textId, domainId)
        events = [(us(-2), None, EVENT_TYPE_IDS["NvtxDomainCreate"], None, "moebench", None, None, 1),
                  (us(-1), us(-0.5), push_pop, None, "warmup:setup", None, None, 0),
                  (us(1), us(11), push_pop, None, None, None, 2, 1),               # textId -> prefill_fresh
                  (us(3), None, EVENT_TYPE_IDS["NvtxMark"], None, "moebench:step", None, None, 1),
                  (us(12), us(20), start_end, 1, "moebench:decode", GLOBAL_TID, None, 1),
                  (us(21), us(25), push_pop, None, "moebench:decode", None, None, 1)]
        con.executemany(
            "INSERT INTO NVTX_EVENTS (start, end, eventType, rangeId, text, globalTid, endGlobalTid, textId, "
            "domainId) VALUES (?,?,?,?,?,?,?,?,?)",
            [(s, e, t, r, text, GLOBAL_TID, end_tid, tid, dom) for s, e, t, r, text, end_tid, tid, dom in events])
        con.commit()
        con.execute("VACUUM")
    finally:
        con.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(DEFAULT_OUT), help=f"output .sqlite (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    path = build(args.out)
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
