"""Which kernels of the compiled 1B decode step (2 layers, 2 rows, the default matmul and attention) XLA launches with
programmatic dependent launch (PDL: the frontend attribute xla.pdl_launch, the kernel starting while its predecessor
drains), and which consumers it marks xla.no_invariant_operands. Prints one line per custom call and per kCustom / kLoop
/ kInput fusion. GPU only (the CPU backend has no PDL).

    python lab/probes/pdl_annotations.py
"""

import re
import sys

sys.path.insert(0, __file__.rsplit("/", 3)[0])

from jphoton import LLM  # noqa: E402
from jphoton.engine.step import StepShape  # noqa: E402
from lab.common import compiled_text  # noqa: E402


def main() -> None:
    llm = LLM("random:llama3.2-1b:layers=2", max_model_len=512, max_num_seqs=2, decode_buckets=(2,),
              prefill_buckets=((1, 32),), warmup=False, progress=False, num_kv_pages=80)
    runner = llm.engine.runner
    shape = StepShape(2, 0, 0, 0)
    runner.layout(shape)
    counts: dict[tuple[str, bool], int] = {}
    for line in compiled_text(runner, shape).splitlines():
        kind = "custom-call" if " custom-call(" in line else next(
            (k for k in ("kCustom", "kLoop", "kInput") if " fusion(" in line and f"kind={k}" in line), None)
        if kind is None or "ENTRY" in line:
            continue
        pdl = "xla.pdl_launch" in line
        counts[kind, pdl] = counts.get((kind, pdl), 0) + 1
        target = re.search(r'custom_call_target="([^"]+)"', line)
        name = line.split("=")[0].strip()
        print(f"{kind:12} pdl={'yes' if pdl else 'no ':3} no_invariant={'yes' if 'no_invariant' in line else 'no '} "
              f"{name[:48]:48} {target[1] if target else ''}", flush=True)
    print("summary:", {f"{k} pdl={p}": n for (k, p), n in sorted(counts.items())}, flush=True)


if __name__ == "__main__":
    main()
