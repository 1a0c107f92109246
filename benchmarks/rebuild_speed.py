"""How fast a collection is written again from its token ids (``distill --tokens-from``) against how long its
shards took to generate: the first --shards shards of a collection's data/tokens.npz rebuilt into a temporary folder
by teacher forcing, their seconds beside the collection's own (meta.json), on this machine.

Usage: python benchmarks/rebuild_speed.py DATA_DIR [--shards 3] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from lssp.distill import collection_model, collection_spec  # noqa: E402
from lssp.distill.tokens import TOKENS_FILE, rebuild_shards  # noqa: E402
from lssp.models.loading import load_model  # noqa: E402
from lssp.models.registry import load_registry  # noqa: E402
from lssp.report.results import RunInfo  # noqa: E402

TARGET = "smollm2-135m-compact"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    spec = load_registry(REPO / "models.yaml").get(TARGET)
    target = collection_model(load_model(collection_spec(spec, torch.device("cpu")) or spec).model)
    meta = json.loads((args.data_dir / "meta.json").read_text())
    with np.load(args.data_dir / TOKENS_FILE) as stored:
        names = [f["name"].removesuffix(".pt") for f in meta["files"][: args.shards]]
        subset = {key: stored[key] for key in stored.files if key.split("/")[0] in names}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.npz"
        np.savez(path, **subset)
        start = time.perf_counter()
        rebuild_shards(target, path, Path(tmp) / "data")
        seconds = time.perf_counter() - start
        rebuilt = json.loads((Path(tmp) / "data" / "meta.json").read_text())["files"]
    for entry, again in zip(meta["files"], rebuilt):
        rows.append({"shard": entry["name"], "tokens": entry["tokens"] + entry["held_out_tokens"],
                     "generated_s": round(entry["seconds"], 2), "rebuilt_s": round(again["seconds"], 2)})
        print(rows[-1])
    info = RunInfo.here("cpu")
    result = {"run_id": info.run_id, "env": info.env, "data_dir": str(args.data_dir), "seconds": seconds,
              "command": "python " + " ".join(sys.argv), "rows": rows,
              "note": "generated_s: when collected (another moment of the same machine, maybe busier)"}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
