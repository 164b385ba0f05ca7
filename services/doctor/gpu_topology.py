"""Reading `nvidia-smi topo -m`: which GPU pairs talk over NVLink and which over PCIe (pure parsing)."""

import re
from dataclasses import dataclass

_GPU = re.compile(r"GPU\d+")
_ESCAPES = re.compile(r"\x1b\[[0-9;]*m")  # nvidia-smi underlines the header on some versions

# The matrix's link codes, as nvidia-smi's legend explains them.
LINKS = {
    "X": "self",
    "SYS": "PCIe + the SMP interconnect between NUMA nodes (slowest)",
    "NODE": "PCIe + the interconnect between PCIe host bridges in one NUMA node",
    "PHB": "PCIe + a PCIe host bridge",
    "PXB": "several PCIe bridges",
    "PIX": "at most one PCIe bridge",
}


@dataclass(frozen=True)
class GpuLink:
    a: str
    b: str
    code: str

    @property
    def nvlink(self) -> bool:
        return self.code.startswith("NV")

    @property
    def description(self) -> str:
        if self.nvlink:
            return f"NVLink ({self.code[2:] or '?'} links)"
        return LINKS.get(self.code, self.code)


def parse_topology(text: str) -> list[GpuLink]:
    """Every GPU pair (each once) with its link code, from `nvidia-smi topo -m` output."""
    lines = [_ESCAPES.sub("", line).rstrip() for line in text.splitlines() if line.strip()]
    header = next((line for line in lines if line.split() and _GPU.fullmatch(line.split()[0])), None)
    if header is None:
        return []
    columns = [c for c in header.split() if _GPU.fullmatch(c)]
    links = []
    for line in lines[lines.index(header) + 1:]:
        cells = line.split()
        if not cells or not cells[0].startswith("GPU") or cells[0] not in columns:
            continue
        row = columns.index(cells[0])
        for index, code in enumerate(cells[1:1 + len(columns)]):
            if index > row:  # each pair once, not the diagonal
                links.append(GpuLink(columns[row], columns[index], code))
    return links


def summarize_links(links: list[GpuLink]) -> str:
    if not links:
        return "one GPU: no GPU-to-GPU links"
    nvlink = [link for link in links if link.nvlink]
    pcie = [link for link in links if not link.nvlink]
    parts = []
    if nvlink:
        parts.append(f"{len(nvlink)} pair(s) over NVLink")
    if pcie:
        slowest = sorted(pcie, key=lambda link: list(LINKS).index(link.code) if link.code in LINKS else 0)[0]
        parts.append(f"{len(pcie)} pair(s) over PCIe only (e.g. {slowest.a}-{slowest.b}: {slowest.description}); "
                     "KV between them goes through host memory")
    return "; ".join(parts)
