"""Per-layer activation predictors (`pi-train-predictors`) and masked-FFN perplexity (`pi-eval`).

See docs/predictors.md. Typed entry points: `train.train_predictors`, `train.load_predictors`,
`evaluate.evaluate`.
"""
