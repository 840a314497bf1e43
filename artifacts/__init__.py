"""The schemas of a run directory's artifacts: one module per artifact, each file a typed dataclass checked on load.

- `RUN/profile/` (pi-profile): `neurons.parquet`, `meta.json` (`ProfileMeta`), `samples/`: artifacts/profile.py
  (`read_profile`, `check_profile`).
- `RUN/placement/` (pi-solve): `placement.parquet`, `meta.json` (`PlacementMeta`), `summary.json`
  (`PlacementSummary`): artifacts/placement.py (`read_placement` and `Placement`, the mask the runtime loads); a
  mixture of experts' `experts.parquet`: artifacts/experts.py (`read_expert_placement`, `ExpertPlacement`).
- `RUN/predictors/` (pi-train-predictors): `predictors.safetensors`, `meta.json` (`PredictorsMeta`), `summary.json`
  (`PredictorsSummary`): artifacts/predictors.py; the tensors, read into `Predictor` networks (`load_predictors`,
  `check_predictors`): artifacts/predictor_file.py.
- the eval report `RUN/eval/eval.json` (pi-eval, `EvalReport`): artifacts/predictors.py too (its modes are the
  predictors' masks).

The machinery they share lives in common/: JSON sections and versions, atomic writes (common/schema.py); staged
folders, sha256 of inputs, `StageMeta`, table checks and model fingerprint checks (common/artifacts.py).
docs/artifacts.md lists every key.
"""
