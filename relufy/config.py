"""pi-relufy's settings: `RelufyConfig` and its named presets (light: `pi-relufy --help` reads them before torch
loads)."""

from __future__ import annotations

from dataclasses import dataclass

from hotneurons.common.kinds import choose

ACTIVATIONS = ("relu", "drelu", "fatrelu")
PENALTIES = ("h", "gate-cos")
SOURCE_ACTIVATIONS = ("swiglu", "geglu", "reglu", "drelu", "fatrelu")  # gated FFNs the swap applies to


class RelufyError(ValueError):
    pass


class RelufyInterrupted(RelufyError):
    """Ctrl-C in the training loop: what was kept, for the CLI's exit code 130."""


@dataclass(frozen=True)
class RelufyConfig:
    """One relufication: activation, loss weights, data and schedule."""

    activation: str = "relu"  # relu, drelu, fatrelu
    fat_threshold: float = 0.0  # fatrelu: values at or below it are zeroed
    tokens: int = 8_000_000  # training budget in token-steps (batches * batch_size * seq_len)
    seq_len: int = 256
    batch_size: int = 32
    lr: float = 2e-4  # AdamW; linear warmup over `warmup` of the steps, then cosine to lr / 10
    warmup: float = 0.05
    weight_decay: float = 0.0
    kl: float = 1.0  # weight of KL(teacher || student) on the next-token distributions
    lm: float = 0.0  # weight of the plain next-token loss on the pool
    l1: float = 0.0  # final weight of the sparsity penalty (`penalty`), a mean over layers, tokens and neurons
    penalty: str = "h"  # h: mean |h| (ProSparse's L1); gate-cos: mean ReLU(cos(FFN input, gate row)), scale-free
    l1_ramp: float = 0.5  # share of the steps over which the L1 weight rises to `l1`
    l1_stages: int = 4  # the rise in this many equal steps (ProSparse); 0: linear
    # share of the steps after which the penalty stops: the rest of training recovers quality under KL alone, and
    # a ReLU neuron turned off for a token gets no gradient that could turn it back on, so the zeros mostly stay
    l1_until: float = 1.0
    dataset: str = "wikipedia-sample"
    text_column: str = "text"
    corpus_tokens: int = 1_000_000  # at most this many corpus tokens in the pool
    teacher_text: float = 0.5  # share of the pool's rows sampled from the teacher
    prompt_tokens: int = 8  # corpus tokens that start each teacher sample
    # share of the teacher rows made of chat exchanges (a corpus snippet as the user's turn, the teacher's answer),
    # where the tokenizer has a chat template: without them the student keeps the teacher's text but not its turns
    chat_share: float = 0.5
    chat_tokens: int = 96  # at most this many answer tokens an exchange
    top_p: float = 0.95
    gen_batch: int = 256  # teacher samples generated at once
    eval_dataset: str = "wikipedia-sample:eval"
    eval_tokens: int = 65_536
    checkpoint_every: int = 200  # steps
    seed: int = 0

    def __post_init__(self):
        choose(self.activation, ACTIVATIONS, "activation", RelufyError)
        choose(self.penalty, PENALTIES, "penalty", RelufyError)
        if self.tokens <= 0:
            raise RelufyError(f"a training budget of {self.tokens} tokens: give a positive number of tokens")
        if not 0 <= self.teacher_text < 1:
            raise RelufyError(f"teacher text share {self.teacher_text}: give a share in [0, 1)")
        if self.seq_len <= self.prompt_tokens:
            raise RelufyError(f"sequence length {self.seq_len} must exceed the {self.prompt_tokens} prompt tokens")
        if self.kl <= 0 and self.lm <= 0:
            raise RelufyError("both the KL and the LM loss weights are 0: nothing to train on")

    @property
    def steps(self) -> int:
        return max(1, self.tokens // (self.batch_size * self.seq_len))


PRESETS: dict[str, RelufyConfig] = {
    "default": RelufyConfig(),
    # ReLU at ReluLLaMA's level in a few minutes on an H100/H200-class GPU
    "quick": RelufyConfig(tokens=2_000_000, eval_tokens=32_768),
    # the scale-free penalty, ramped over the first 30%: ~88% exact zeros on SmolLM2-135M (docs/relufy.md)
    "sparse": RelufyConfig(tokens=10_000_000, penalty="gate-cos", l1=100.0, l1_ramp=0.3),
    # seconds on a CPU, for tests and tiny models
    "tiny": RelufyConfig(tokens=2048, seq_len=32, batch_size=4, corpus_tokens=2048, gen_batch=8, eval_tokens=256,
                         checkpoint_every=4, warmup=0.1),
}


def preset(name: str) -> RelufyConfig:
    return PRESETS[choose(name, PRESETS, "preset", RelufyError)]
