"""The golden file format shared by the make_golden*.py scripts and tests/cpp/ref_util.h (load_golden):
one tensor per line, `<case>.<name> <ndim> <d0> ... <v0> <v1> ...`, float64 values as %.17g (exact round
trip; -inf / inf / nan as written by Python)."""
import pathlib

import torch


class GoldenWriter:
    def __init__(self):
        self.lines = []

    def put(self, case, name, t):
        t = t.detach().to(torch.float64).contiguous()
        vals = " ".join(f"{v:.17g}" for v in t.flatten().tolist())
        self.lines.append(f"{case}.{name} {t.dim()} {' '.join(str(s) for s in t.shape)} {vals}")

    def write(self, script, filename):
        """Writes beside `script` (the caller's __file__)."""
        path = pathlib.Path(script).with_name(filename)
        path.write_text("\n".join(self.lines) + "\n")
        print(f"wrote {path} ({len(self.lines)} tensors, {path.stat().st_size} bytes)")
