"""Train ferry's bundled default model and its draft model from scratch, then evaluate both.

    python tools/build_corpus.py --out .train/corpus.jsonl
    python tools/train_default_model.py --corpus .train/corpus.jsonl --out .train/run
    python tools/train_default_model.py --plot .train/run/metrics.json  # docs/default-model-training.png

Stages, in order (each prints its progress and wall time):
1. tokenizer: byte-level BPE (4096 entries) trained on the corpus's train split.
2. data: the train split as one token stream `<|bos|> file <|eos|> <|bos|> file ...`, and chat
   examples derived from its docstrings (see `chat_pairs`), rendered with the chat template.
3. main model: pretraining on random windows of the stream; over the last `chat_fraction` of the
   steps, `chat_rows` rows of each batch are chat windows (loss on the assistant's tokens only),
   the rest still documents so that completion does not suffer. Saved at once.
4. draft model: the same data and schedule, trained to match the main model's next-token
   distribution (distillation) as well as the data. Saved at once.
5. evaluation of the saved bfloat16 weights: perplexity on the test split for both models and for
   a bigram baseline, the draft's greedy agreement with the main model, sample completions and chat
   answers. Everything lands in `<out>/metrics.json`.

The seed is fixed; GPU kernels are not bitwise deterministic, so a rerun matches closely, not bit
for bit. `--preset tiny` runs every stage in a few minutes on a CPU, to check the script end to end.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import inspect
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SEED = 0
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, END = range(len(SPECIAL_TOKENS))

# One line, so that Jinja's trim_blocks/lstrip_blocks cannot change its output; the BOS token is
# spelled out because not every renderer passes `bos_token`.
CHAT_TEMPLATE = (
    "{{ '<|bos|>' }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant who knows the Python standard library.",
    "Answer questions about Python concisely.",
]

CODE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "def read_json(path):", "for i in range("]
CHAT_PROMPTS = [
    "What does `os.path.join` do?",
    "What is the `json` module for?",
    "What does `shutil.copyfile` do?",
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    "How do I read a file line by line?",
    "What are the parameters of `json.dumps`?",
    "What does `random.choice` do?",
    "What does `pprint.pformat` do?",  # pprint is in the test split: never seen in training
]


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int


@dataclass(frozen=True)
class Plan:
    steps: int
    batch: int  # sequences per step
    seq_len: int
    lr: float
    warmup: int
    chat_fraction: float  # the last part of the steps, where chat windows join each batch
    chat_rows: int  # chat windows per batch in that part
    dropout: float  # on the attention and MLP outputs, during training only
    eval_every: int
    max_seconds: float  # a slower machine than planned for gets fewer steps, not a timeout

    def __post_init__(self):
        if not 0 <= self.chat_rows <= self.batch:
            raise ValueError(f"chat_rows must be in [0, batch={self.batch}], got {self.chat_rows}")

    @property
    def chat_start(self) -> int:
        """The number of steps before chat windows join the batches."""
        return round(self.steps * (1 - self.chat_fraction))


@dataclass(frozen=True)
class Preset:
    main: Shape
    draft: Shape
    main_plan: Plan
    draft_plan: Plan
    max_position_embeddings: int
    max_docs: int | None  # None: the whole corpus
    eval_windows: int | None  # None: the whole test split


_FULL_PLAN = Plan(steps=5000, batch=16, seq_len=2048, lr=2e-3, warmup=200, chat_fraction=0.2, chat_rows=4,
                  dropout=0.1, eval_every=250, max_seconds=300)
PRESETS = {
    "full": Preset(
        main=Shape(hidden=384, layers=6, heads=6, kv_heads=2, ffn=896),
        draft=Shape(hidden=128, layers=3, heads=4, kv_heads=2, ffn=384),
        main_plan=_FULL_PLAN,
        draft_plan=replace(_FULL_PLAN, lr=3e-3, dropout=0.0, max_seconds=200),
        max_position_embeddings=2048,
        max_docs=None,
        eval_windows=None,
    ),
    "tiny": Preset(
        main=Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128),
        draft=Shape(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64),
        main_plan=Plan(steps=40, batch=4, seq_len=128, lr=3e-3, warmup=5, chat_fraction=0.3, chat_rows=2,
                       dropout=0.1, eval_every=10, max_seconds=600),
        draft_plan=Plan(steps=40, batch=4, seq_len=128, lr=3e-3, warmup=5, chat_fraction=0.3, chat_rows=2,
                        dropout=0.0, eval_every=10, max_seconds=600),
        max_position_embeddings=256,
        max_docs=300,
        eval_windows=8,
    ),
}


class Log:
    """Prints progress with the time since start, and collects everything for metrics.json."""

    def __init__(self, path: Path):
        self.path = path
        self.start = time.perf_counter()
        self.metrics: dict = {}

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {message}", flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def record(self, key: str, value) -> None:
        self.metrics[key] = value
        self.path.write_text(json.dumps(self.metrics, indent=1))


# ---- 1. tokenizer -------------------------------------------------------------------------------


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE: any string round-trips exactly, which source code needs (indentation, tabs,
    non-ASCII literals). The post-processor adds <|bos|> to every encoded text, so a plain prompt
    starts the way every training document does."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B:1", special_tokens=[("<|bos|>", BOS)]
        ),
    ])
    return tokenizer


def write_tokenizer_files(tokenizer: Tokenizer, folder: Path, model_max_length: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "additional_special_tokens": SPECIAL_TOKENS[3:],
        "add_bos_token": True,
        "add_eos_token": False,
        # Decoding must give back the exact bytes; the clean-up would rewrite " ." and " ,".
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {**special, "additional_special_tokens": SPECIAL_TOKENS[3:]}
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


# ---- 2. data ------------------------------------------------------------------------------------


def module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    name = ".".join(parts)
    return {"posixpath": "os.path"}.get(name, name)


def is_public_module(path: str) -> bool:
    parts = path.removesuffix(".py").split("/")
    tests = {"test", "tests", "idle_test"}
    return not any(p in tests or p.startswith("test_") or (p.startswith("_") and p != "__init__") for p in parts)


def first_paragraph(docstring: str) -> str | None:
    """The docstring's first paragraph on one line; None when too short or long to be an answer."""
    lines = inspect.cleandoc(docstring).split("\n\n")[0].splitlines()
    text = " ".join(line.strip() for line in lines)
    return text if 12 <= len(text) <= 600 else None


def task_from(paragraph: str) -> str | None:
    """The docstring's first sentence as the rest of "Write a function ...": "Return the
    absolute path." -> "to return the absolute path."; None when it does not start with a verb."""
    head = paragraph.split(". ")[0].rstrip(".")
    verb = head.split(" ")[0]
    if not verb.isalpha() or verb.lower() in _NOT_VERBS:
        return None
    # Docstrings say "Return ..." or "Returns ...": "to return", "that returns".
    joint = "that" if verb.endswith("s") and not verb.endswith("ss") else "to"
    return f"{joint} {head[0].lower()}{head[1:]}."


_NOT_VERBS = {"this", "the", "a", "an", "internal", "helper", "deprecated", "same", "used", "private", "like",
              "equivalent", "shorthand", "alias", "for", "if", "when", "see", "note", "in", "it", "called"}


def describe_pairs(name: str, kind: str, summary: str, rng: random.Random) -> list[tuple[str, str]]:
    questions = {
        "module": ["What is the `{n}` module for?", "What does the `{n}` module do?", "Tell me about `{n}`."],
        "class": ["What is `{n}`?", "What is the `{n}` class for?", "Explain `{n}`."],
        "function": ["What does `{n}` do?", "Explain `{n}`.", "What is `{n}` for?"],
    }[kind]
    return [(rng.choice(questions).format(n=name), summary)]


def function_pairs(module: str, node: ast.FunctionDef, lines: list[str], summary: str, rng: random.Random,
                   top_level: bool) -> list[tuple[str, str]]:
    name = f"{module}.{node.name}"
    signature = f"{node.name}({ast.unparse(node.args)})"
    pairs = describe_pairs(name, "function", summary, rng)
    if rng.random() < 0.3:  # for 30% of functions: all of them would make a third of all pairs
        pairs.append((f"What are the parameters of `{name}`?", f"`{name}` is defined as `{signature}`."))
    code = "\n".join(lines[node.lineno - 1:node.end_lineno])
    task = task_from(summary)
    if top_level and task and node.end_lineno - node.lineno < 40 and len(code) < 1500:
        ask = rng.choice(["Write a Python function `{s}` {t}", "Write a function {t}", "Implement `{s}` {t}"])
        pairs.append((ask.format(s=signature, t=task), f"```python\n{code}\n```"))
    return pairs


def chat_pairs(path: str, source: str, rng: random.Random) -> list[tuple[str, str]]:
    """(question, answer) pairs from one module: what a module, class or function is for (its
    docstring's first paragraph), its signature, and a function's code from its description."""
    module = module_name(path)
    tree, lines = ast.parse(source), source.splitlines()
    pairs = []
    doc = ast.get_docstring(tree)
    if doc and (summary := first_paragraph(doc)):
        pairs += describe_pairs(module, "module", summary, rng)
    for node in tree.body:
        pairs += definition_pairs(module, node, lines, rng, top_level=True)
    return pairs


def definition_pairs(scope: str, node: ast.AST, lines: list[str], rng: random.Random,
                     top_level: bool) -> list[tuple[str, str]]:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
        return []
    doc = ast.get_docstring(node)
    summary = first_paragraph(doc) if doc else None
    pairs = []
    if isinstance(node, ast.ClassDef):
        if summary:
            pairs += describe_pairs(f"{scope}.{node.name}", "class", summary, rng)
        for child in node.body:
            pairs += definition_pairs(f"{scope}.{node.name}", child, lines, rng, top_level=False)
    elif summary:
        pairs += function_pairs(scope, node, lines, summary, rng, top_level)
    return pairs


def conversations(pairs: list[tuple[str, str]], rng: random.Random) -> list[list[dict]]:
    """Pairs grouped into conversations: mostly one turn, sometimes two, sometimes with a system
    prompt, so that every shape the chat template can render has been seen."""
    chats, i = [], 0
    while i < len(pairs):
        turns = 2 if rng.random() < 0.2 and i + 1 < len(pairs) else 1
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.25 else []
        for question, answer in pairs[i:i + turns]:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        chats.append(messages)
        i += turns
    return chats


def encode_chat(tokenizer: Tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered chat and a 0/1 mask of the tokens to learn: the assistant's
    content and its closing <|end|>. Each assistant turn is encoded apart from its prompt so that
    the prompt's tokens equal what `add_generation_prompt=True` yields at inference."""
    ids, mask = [BOS], [0]
    for message in messages:
        role = [SPECIAL_TOKENS.index(f"<|{message['role']}|>")] + encode(tokenizer, "\n")
        content = encode(tokenizer, message["content"]) + [END]
        learn = int(message["role"] == "assistant")
        ids += role + content + encode(tokenizer, "\n")
        mask += [0] * len(role) + [learn] * len(content) + [0]
    return ids, mask


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def document_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    ids = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids += [BOS, *encoding.ids, EOS]
    return torch.tensor(ids, dtype=torch.int32)


def chat_stream(tokenizer: Tokenizer, docs: list[dict], log: Log) -> tuple[torch.Tensor, torch.Tensor]:
    rng = random.Random(SEED)
    pairs = [p for d in docs if is_public_module(d["path"]) for p in chat_pairs(d["path"], d["text"], rng)]
    rng.shuffle(pairs)
    chats = conversations(pairs, rng)
    ids, mask = [], []
    for messages in chats:
        chat_ids, chat_mask = encode_chat(tokenizer, messages)
        ids += chat_ids
        mask += chat_mask
    log(f"chat: {len(pairs)} pairs in {len(chats)} conversations, {len(ids):,} tokens, {sum(mask):,} learned")
    log.record("chat_data", {"pairs": len(pairs), "conversations": len(chats), "tokens": len(ids),
                             "learned_tokens": sum(mask), "examples": chats[:3]})
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.bool)


@dataclass
class Data:
    train: torch.Tensor  # (N,) int32 token stream of the train split
    val: torch.Tensor
    test: torch.Tensor
    chat: torch.Tensor
    chat_mask: torch.Tensor  # (N_chat,) True where the token is learned

    def to(self, device: str) -> Data:
        return Data(*(getattr(self, k).to(device) for k in ("train", "val", "test", "chat", "chat_mask")))


class Batches:
    """Random windows of a plan's length: from the document stream, and in the chat phase
    `chat_rows` of them from the chat stream (targets outside the assistant's answers set to -100)."""

    def __init__(self, data: Data, plan: Plan, device: str):
        self.data, self.plan, self.device = data, plan, device
        self.generator = torch.Generator().manual_seed(SEED)

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        n_chat = self.plan.chat_rows if step >= self.plan.chat_start else 0
        x, y = self.windows(self.data.train, None, self.plan.batch - n_chat)
        if n_chat:
            cx, cy = self.windows(self.data.chat, self.data.chat_mask, n_chat)
            x, y = torch.cat([x, cx]), torch.cat([y, cy])
        return x, y

    def windows(self, stream: torch.Tensor, mask: torch.Tensor | None, rows: int):
        T = self.plan.seq_len
        starts = torch.randint(0, len(stream) - T - 1, (rows,), generator=self.generator)
        index = (starts[:, None] + torch.arange(T + 1)).to(self.device)  # (rows, T + 1)
        tokens = stream[index].long()
        y = tokens[:, 1:].clone()
        if mask is not None:
            y[~mask[index[:, 1:]]] = -100
        return tokens[:, :-1], y


def eval_windows(stream: torch.Tensor, T: int, limit: int | None) -> torch.Tensor:
    """The stream cut into consecutive windows of T + 1 tokens (the last partial one dropped)."""
    n = (len(stream) - 1) // T
    if limit is not None:
        n = min(n, limit)
    index = torch.arange(n, device=stream.device)[:, None] * T + torch.arange(T + 1, device=stream.device)
    return stream[index].long()  # (n, T + 1)


# ---- 3 and 4. models and training --------------------------------------------------------------


def make_model(shape: Shape, max_positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=[EOS, END],
        pad_token_id=PAD,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def add_dropout(model, p: float) -> list:
    """Dropout on each block's attention and MLP outputs (Llama has none of its own): the corpus
    is small, and the model sees it many times. Hooks, so the saved model is a plain Llama."""

    def drop(module, args, output):
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, module.training), *output[1:])
        return F.dropout(output, p, module.training)

    return [m.register_forward_hook(drop) for layer in model.model.layers for m in (layer.self_attn, layer.mlp)]


def learning_rate(plan: Plan, step: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < plan.warmup:
        return plan.lr * (step + 1) / plan.warmup
    progress = (step - plan.warmup) / max(1, plan.steps - plan.warmup)
    return plan.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, plan: Plan, device: str) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=plan.lr, betas=(0.9, 0.95), fused=device == "cuda")


def autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)


def distill_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position, averaged where the position is learned."""
    kl = F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(teacher_logits.float(), -1),
                  log_target=True, reduction="none").sum(-1)
    keep = (y != -100).float()
    return (kl * keep).sum() / keep.sum()


@torch.no_grad()
def teacher_forward(teacher, x: torch.Tensor) -> torch.Tensor | None:
    return teacher(input_ids=x).logits if teacher is not None else None


@torch.no_grad()
def mean_loss(model, windows: torch.Tensor, device: str, rows: int = 16) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), rows):
        chunk = windows[i:i + rows]
        with autocast(device):
            logits = model(input_ids=chunk[:, :-1]).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    model.train()
    return total / count


def train_step(model, optimizer, x: torch.Tensor, y: torch.Tensor, device: str, teacher) -> torch.Tensor:
    """One update; returns the cross-entropy on the data. With a teacher, the loss is half that
    and half the KL divergence to the teacher's next-token distribution."""
    with autocast(device):
        logits = model(input_ids=x).logits
        teacher_logits = teacher_forward(teacher, x)
    ce = lm_loss(logits, y)
    loss = ce if teacher_logits is None else 0.5 * ce + 0.5 * distill_loss(logits, teacher_logits, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return ce.detach()


class BestWeights:
    """The pretraining weights of lowest validation loss: should the model have begun to overfit
    the small corpus by the end of pretraining, the chat phase starts from these instead."""

    def __init__(self):
        self.loss, self.state = math.inf, None

    def update(self, model, loss: float) -> None:
        if loss < self.loss:
            self.loss, self.state = loss, {k: v.detach().clone() for k, v in model.state_dict().items()}

    def restore_if_better(self, model, loss: float, log: Log) -> None:
        if self.state is not None and loss > self.loss * 1.01:
            model.load_state_dict(self.state)
            log(f"restored the pretraining weights of validation loss {self.loss:.3f} (now {loss:.3f})")


def fit_in_time(plan: Plan, seconds_per_step: float, done: int, log: Log) -> Plan:
    """The plan, with fewer steps if it would not end within `max_seconds` (evaluation included,
    roughly), but at least twice the `done` ones; the schedule and the chat phase shrink with it."""
    steps = max(2 * done, int(plan.max_seconds / (1.1 * seconds_per_step)))
    planned = plan.steps * seconds_per_step
    log(f"{seconds_per_step * 1000:.1f} ms per step: {plan.steps} steps take about {planned:.0f}s")
    if steps >= plan.steps:
        return plan
    log(f"too slow for max_seconds={plan.max_seconds}: {steps} steps instead of {plan.steps}")
    return replace(plan, steps=steps, eval_every=max(1, plan.eval_every * steps // plan.steps))


def train(model, plan: Plan, data: Data, device: str, log: Log, name: str, teacher=None) -> dict:
    """Trains in place; returns the loss curves."""
    torch.manual_seed(SEED)
    hooks = add_dropout(model, plan.dropout) if plan.dropout else []
    optimizer = make_optimizer(model, plan, device)
    batches, best = Batches(data, plan, device), BestWeights()
    val = eval_windows(data.val, plan.seq_len, None)
    curve = {"step": [], "train_loss": [], "val_step": [], "val_loss": []}
    model.train()
    t0, running = time.perf_counter(), []
    step, timed_from = 0, None
    while step < plan.steps:
        step += 1
        if step == 11:  # time steps 11 to 30: the first ones pay for warm-up
            timed_from = time.perf_counter()
        if step == 31:
            plan = fit_in_time(plan, (time.perf_counter() - timed_from) / 20, step, log)
            batches.plan = plan
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(plan, step - 1)
        running.append(train_step(model, optimizer, *batches.get(step - 1), device, teacher))
        if step % 10 == 0 or step == plan.steps:
            curve["step"].append(step)
            curve["train_loss"].append(torch.stack(running).mean().item())
            running = []
        if step % plan.eval_every == 0 or step in (plan.chat_start, plan.steps):
            curve["val_step"].append(step)
            curve["val_loss"].append(mean_loss(model, val, device))
            rate = step * plan.batch * plan.seq_len / (time.perf_counter() - t0)
            last_train = curve["train_loss"][-1] if curve["train_loss"] else math.nan
            log(f"{name} step {step}/{plan.steps} lr {learning_rate(plan, step - 1):.2e} "
                f"train {last_train:.3f} val {curve['val_loss'][-1]:.3f} ({rate:,.0f} tok/s)")
            if step <= plan.chat_start:
                best.update(model, curve["val_loss"][-1])
            if step == plan.chat_start:
                best.restore_if_better(model, curve["val_loss"][-1], log)
    for hook in hooks:
        hook.remove()
    model.eval()
    curve["seconds"], curve["steps"] = time.perf_counter() - t0, plan.steps
    return curve


def save_model(model, tokenizer: Tokenizer, folder: Path, max_positions: int, license_file: Path) -> None:
    """bfloat16 safetensors plus the tokenizer: a folder transformers and ferry load as it is. The
    corpus's license goes with it: the PSF License asks that it be kept with derived works."""
    from transformers import GenerationConfig

    shipped = copy.deepcopy(model).to(torch.bfloat16)
    shipped.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=[EOS, END], pad_token_id=PAD)
    shipped.save_pretrained(folder, safe_serialization=True)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    # transformers 5 nests rope_theta in rope_parameters; older readers look for it at the top.
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_tokenizer_files(tokenizer, folder, max_positions)
    if license_file.is_file():
        shutil.copyfile(license_file, folder / "LICENSE.txt")


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- 5. evaluation ------------------------------------------------------------------------------


def bigram_perplexities(train: torch.Tensor, windows: torch.Tensor) -> dict:
    """A bigram model counted on the train stream, scored on the same predicted tokens as the
    networks. Add-one smoothing, and interpolation with an add-one unigram, whose weight is the
    best on the test tokens themselves (which favours the baseline)."""
    V = VOCAB_SIZE
    train = train.long()
    pair_counts = torch.bincount(train[:-1] * V + train[1:], minlength=V * V).view(V, V).double()
    context_counts = pair_counts.sum(1, keepdim=True)
    unigram = (torch.bincount(train, minlength=V).double() + 1) / (len(train) + V)
    prev, nxt = windows[:, :-1].flatten(), windows[:, 1:].flatten()
    add_one = (pair_counts[prev, nxt] + 1) / (context_counts[prev, 0] + V)
    bigram_ml = pair_counts[prev, nxt] / context_counts[prev, 0].clamp(min=1)
    result = {"add_one": math.exp(-add_one.log().mean().item())}
    best = min((math.exp(-(lam * bigram_ml + (1 - lam) * unigram[nxt]).log().mean().item()), lam)
               for lam in [i / 20 for i in range(20)])
    result["interpolated"], result["interpolation_weight"] = best
    return result


@torch.no_grad()
def compare_models(main, draft, windows: torch.Tensor, rows: int = 8) -> dict:
    """Perplexity of both models and how often the draft's greedy next token is the main
    model's, over every predicted position of the test windows."""
    nll_main = nll_draft = agree = count = 0.0
    for i in range(0, len(windows), rows):
        chunk = windows[i:i + rows]
        x, y = chunk[:, :-1], chunk[:, 1:].flatten()
        main_logits = main(input_ids=x).logits.float().flatten(0, 1)
        draft_logits = draft(input_ids=x).logits.float().flatten(0, 1)
        nll_main += F.cross_entropy(main_logits, y, reduction="sum").item()
        nll_draft += F.cross_entropy(draft_logits, y, reduction="sum").item()
        agree += (main_logits.argmax(-1) == draft_logits.argmax(-1)).sum().item()
        count += y.numel()
    return {"tokens": int(count), "main_ppl": math.exp(nll_main / count), "draft_ppl": math.exp(nll_draft / count),
            "draft_greedy_agreement": agree / count}


def parsable_lines(text: str) -> tuple[int, int]:
    """(lines of the longest prefix that parses as Python, all lines): a cut-off completion
    usually ends inside a statement, so its last line or block alone may not parse."""
    lines = text.splitlines()
    for k in range(len(lines), 0, -1):
        try:
            ast.parse("\n".join(lines[:k]))
            return k, len(lines)
        except SyntaxError:
            continue
    return 0, len(lines)


@torch.no_grad()
def generate(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, sample: bool) -> str:
    device = next(model.parameters()).device
    torch.manual_seed(SEED)
    options = {"do_sample": True, "temperature": 0.8, "top_p": 0.95} if sample else {"do_sample": False}
    out = model.generate(torch.tensor([prompt_ids], device=device), max_new_tokens=max_new_tokens,
                         eos_token_id=[EOS, END], pad_token_id=PAD, **options)
    return tokenizer.decode(out[0, len(prompt_ids):].tolist(), skip_special_tokens=True)


def samples(model, tokenizer, max_new_tokens: int) -> dict:
    completions = []
    for prompt in CODE_PROMPTS:
        ids = tokenizer(prompt)["input_ids"]  # <|bos|> is added
        for sample in (False, True):
            text = generate(model, tokenizer, ids, max_new_tokens, sample)
            lines_ok, lines = parsable_lines(prompt + text)
            completions.append({"prompt": prompt, "sampled": sample, "completion": text,
                                "parsable_lines": lines_ok, "lines": lines})
    chats = []
    for question in CHAT_PROMPTS:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                 add_generation_prompt=True)
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        chats.append({"question": question, "answer": generate(model, tokenizer, ids, 2 * max_new_tokens, False)})
    return {"completions": completions, "chats": chats}


def evaluate(folders: dict[str, Path], data: Data, preset: Preset, device: str, log: Log) -> None:
    """Everything is measured on the saved folders, loaded back in float32, so the figures are
    those of the bfloat16 weights that ship."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = {k: AutoModelForCausalLM.from_pretrained(v, dtype=torch.float32).to(device).eval()
              for k, v in folders.items()}
    windows = eval_windows(data.test, preset.main_plan.seq_len, preset.eval_windows)
    heldout = compare_models(loaded["main"], loaded["draft"], windows)
    heldout["bigram"] = bigram_perplexities(data.train.cpu(), windows.cpu())
    log(f"test split: {json.dumps(heldout)}")
    log.record("heldout", heldout)
    tokenizer = AutoTokenizer.from_pretrained(folders["main"])
    max_new = 128 if preset.eval_windows is None else 16
    for key, model in loaded.items():
        result = samples(model, tokenizer, max_new)
        log.record(f"samples_{key}", result)
        for c in result["completions"][:2] + result["chats"][:2]:
            log(f"{key}: {json.dumps(c)[:300]}")


def plot_curves(metrics_file: Path, png: Path) -> None:
    """The loss curves of both models, with the chat phase and the bigram baseline marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = json.loads(metrics_file.read_text())
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    for key, color, train_label in [("model", "tab:blue", "train (with dropout)"),
                                    ("draft", "tab:orange", "train (cross-entropy part)")]:
        record, curve = metrics[f"{key}_model"], metrics[f"{key}_model"]["curve"]
        name = f"{'main' if key == 'model' else 'draft'} ({record['parameters'] / 1e6:.1f}M)"
        ax.plot(curve["step"], curve["train_loss"], color=color, alpha=0.35, lw=1, label=f"{name} {train_label}")
        ax.plot(curve["val_step"], curve["val_loss"], color=color, lw=2, marker="o", ms=3, label=f"{name} validation")
    plan = Plan(**metrics["model_model"]["plan"])
    ax.axvspan(plan.chat_start, plan.steps, color="grey", alpha=0.12,
               label=f"chat phase ({plan.chat_rows} of {plan.batch} rows chat)")
    bigram = math.log(metrics["heldout"]["bigram"]["interpolated"])
    ax.axhline(bigram, color="black", ls="--", lw=1, label=f"bigram baseline on the test split ({bigram:.2f})")
    ax.set(xlabel=f"step (batch {plan.batch} x {plan.seq_len} tokens)", ylabel="cross-entropy (nats / token)",
           ylim=(0.9, 5.0), xlim=(0, plan.steps), title="ferry's default model on the CPython standard library")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(png)


# ---- driver -------------------------------------------------------------------------------------


def load_corpus(path: Path, max_docs: int | None) -> dict[str, list[dict]]:
    docs = [json.loads(line) for line in path.open(encoding="utf-8")]
    if max_docs is not None:
        docs = docs[:: max(1, len(docs) // max_docs)]
    splits = {"train": [], "val": [], "test": []}
    for doc in docs:
        splits[doc["split"]].append(doc)
    return splits


def build_data(splits: dict[str, list[dict]], tokenizer: Tokenizer, log: Log) -> Data:
    streams = {k: document_stream(tokenizer, [d["text"] for d in v]) for k, v in splits.items()}
    log("tokens: " + ", ".join(f"{k} {len(v):,}" for k, v in streams.items()))
    log.record("tokens", {k: len(v) for k, v in streams.items()})
    chat, chat_mask = chat_stream(tokenizer, splits["train"], log)
    return Data(streams["train"], streams["val"], streams["test"], chat, chat_mask)


def train_and_save(name: str, shape: Shape, plan: Plan, data: Data, tokenizer: Tokenizer, preset: Preset,
                   device: str, args: argparse.Namespace, log: Log, teacher=None):
    torch.manual_seed(SEED)
    model = make_model(shape, preset.max_position_embeddings).to(device)
    log(f"{name}: {parameter_count(model):,} parameters, {asdict(shape)}, {asdict(plan)}")
    curve = train(model, plan, data, device, log, name, teacher)
    folder = args.out / f"default-{name}"
    save_model(model, tokenizer, folder, preset.max_position_embeddings, args.corpus.parent / "LICENSE.txt")
    size = (folder / "model.safetensors").stat().st_size
    log(f"{name}: trained in {curve['seconds']:.0f}s, saved {folder} ({size:,} bytes)")
    log.record(f"{name}_model", {"parameters": parameter_count(model), "shape": asdict(shape),
                                 "plan": asdict(plan), "safetensors_bytes": size, "curve": curve})
    return model, folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=Path(".train/corpus.jsonl"))
    parser.add_argument("--out", type=Path, default=Path(".train/run"))
    parser.add_argument("--preset", choices=PRESETS, default="full")
    parser.add_argument("--plot", type=Path, metavar="METRICS_JSON",
                        help="only draw the loss curves of a finished run (needs matplotlib)")
    parser.add_argument("--png", type=Path, default=Path("docs/default-model-training.png"))
    args = parser.parse_args()
    if args.plot:
        plot_curves(args.plot, args.png)
        return

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    preset = PRESETS[args.preset]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False  # the evaluation runs in true float32
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "metrics.json")
    corpus_sha = hashlib.sha256(args.corpus.read_bytes()).hexdigest()
    log.record("setup", {"preset": args.preset, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                         "corpus_sha256": corpus_sha, "torch": torch.__version__, "python": sys.version.split()[0]})
    log(f"corpus {args.corpus} sha256 {corpus_sha}, device {device}")

    splits = load_corpus(args.corpus, preset.max_docs)
    tokenizer = train_tokenizer([d["text"] for d in splits["train"]])
    log(f"tokenizer: {tokenizer.get_vocab_size()} entries")
    data = build_data(splits, tokenizer, log).to(device)
    log.record("data_seconds", log.elapsed())

    main_model, main_folder = train_and_save("model", preset.main, preset.main_plan, data, tokenizer, preset,
                                             device, args, log)
    _, draft_folder = train_and_save("draft", preset.draft, preset.draft_plan, data, tokenizer, preset,
                                     device, args, log, teacher=main_model.eval())
    log.record("train_seconds", log.elapsed())
    del main_model
    evaluate({"main": main_folder, "draft": draft_folder}, data, preset, device, log)
    log.record("total_seconds", log.elapsed())
    log(f"done in {log.elapsed():.0f}s")


if __name__ == "__main__":
    main()
