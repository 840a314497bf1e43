"""Per-layer activation predictors (`pi-train-predictors`) and masked-FFN perplexity (`pi-eval`).

See docs/predictors.md. Typed entry points: `train.train_predictors`, `artifacts/predictor_file.load_predictors`,
`evaluate.evaluate`.
"""
