"""Greedy generation with onnxruntime from an exported memory model, token for token as PyTorch.

A character LM around Hecate's l_p memory layer (``LpMemory``, written with torch's
``scan``): embedding → memory (short conv → φ → recurrence) → residual → linear head.
It implements the streaming protocol ``hecate.export_onnx`` exports:

    initial_state(batch)  the conv states (last K−1 projected inputs) and the memory M, all zero
    prefill(ids)          logits of the prompt and the state after it
    step(ids_t, state)    logits of one token and the next state

Two ONNX files come out: ``prefill.onnx`` (batch and prompt length dynamic; the
recurrence is one ``Scan``) and ``decode.onnx`` (one token, batch dynamic, state in and
out; ``step`` is the forward over a one-token sequence, so its memory update is the same
fused recurrence, started from the carried memory). The script trains the model briefly on the pydoc topics text that ships with Python,
exports both, generates greedily with onnxruntime and with PyTorch, and checks that the
tokens are the same.

    python examples/generate_onnx.py            # trains 200 steps first: a minute or two on a free CPU core
    python examples/generate_onnx.py --quick    # seconds: no training
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import hecate
from hecate.models.memory import LpMemory


class MemoryLM(nn.Module):
    """A character LM with one l_p memory layer; ``forward``, ``prefill`` and ``step`` agree."""

    def __init__(self, vocab_size: int, d_model: int = 32, n_heads: int = 2, d_head: int = 8, p: float = 1.0):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        # p = 1 (tanh of the error): a bounded update keeps the memory stable over long generations;
        # p = 2 is a delta rule, which opset 27 writes as ONNX's LinearAttention
        self.memory = LpMemory(d_model, n_heads, d_k=d_head, d_v=d_head, p=p, alpha=None, eta=None,
                               phi="elu1", use_scan=True)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] → logits [B, T, V]."""
        return self.prefill(ids)[0]

    def initial_state(self, batch: int) -> tuple[torch.Tensor, ...]:
        q_conv, k_conv = self.memory.qk.initial_state(batch)  # [B, K−1, H·d_k] each
        m = self.memory
        memory = torch.zeros(batch, m.n_heads, m.d_v, m.d_phi, dtype=q_conv.dtype, device=q_conv.device)
        return q_conv, k_conv, memory

    def prefill(self, ids: torch.Tensor):
        """ids [B, T] → (logits [B, T, V], the state after the last token)."""
        x = self.embed(ids)
        y, memory = self.memory(x)
        q_conv, k_conv = self.initial_state(ids.shape[0])[:2]
        qk = self.memory.qk
        # the conv's state: the last K−1 projected inputs (the zero padding when T < K−1)
        window = q_conv.shape[1]
        q_conv = torch.cat([q_conv, qk.q_proj(x)], dim=1)[:, -window:]
        k_conv = torch.cat([k_conv, qk.k_proj(x)], dim=1)[:, -window:]
        return self.head(x + y), (q_conv, k_conv, memory)

    def step(self, ids_t: torch.Tensor, state):
        """ids_t [B] → (logits [B, V], next state): the forward over a one-token sequence from the carried state,
        so the decode export is the prefill's fused ops, each started from its state (the conv's window, M)."""
        x = self.embed(ids_t).unsqueeze(1)  # [B, 1, d]
        y, (conv_state, memory, _) = self.memory.forward_chunk(x, (state[:2], state[2], None))
        return self.head(x + y)[:, 0], (*conv_state, memory)


def generate_torch(model: MemoryLM, prompt: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Greedy: prefill the prompt, then one step per token. Returns the new tokens [B, n_tokens]."""
    with torch.no_grad():
        logits, state = model.prefill(prompt)
        token = logits[:, -1].argmax(-1)
        tokens = [token]
        for _ in range(n_tokens - 1):
            logits, state = model.step(token, state)
            token = logits.argmax(-1)
            tokens.append(token)
    return torch.stack(tokens, dim=1)


def export(model: MemoryLM, directory: str) -> tuple[str, str]:
    """Write prefill.onnx and decode.onnx under ``directory``."""
    prefill_path, decode_path = os.path.join(directory, "prefill.onnx"), os.path.join(directory, "decode.onnx")
    example = torch.zeros(2, 5, dtype=torch.long)
    hecate.export_onnx(model, (example,), prefill_path, mode="prefill")
    hecate.export_onnx(model, (example[:, 0],), decode_path, mode="decode")
    return prefill_path, decode_path


def generate_onnx(prefill_path: str, decode_path: str, prompt: np.ndarray, n_tokens: int) -> np.ndarray:
    """The same greedy loop with onnxruntime: the state goes from one call's outputs to the next's inputs."""
    import onnxruntime as ort

    prefill = ort.InferenceSession(prefill_path, providers=["CPUExecutionProvider"])
    decode = ort.InferenceSession(decode_path, providers=["CPUExecutionProvider"])
    logits, *state = prefill.run(None, {"x": prompt})
    token = logits[:, -1].argmax(-1)
    tokens = [token]
    state_names = [i.name for i in decode.get_inputs()][1:]
    for _ in range(n_tokens - 1):
        logits, *state = decode.run(None, {"x_t": token, **dict(zip(state_names, state))})
        token = logits.argmax(-1)
        tokens.append(token)
    return np.stack(tokens, axis=1)


def load_text() -> tuple[str, list[str]]:
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    return text, sorted(set(text))


def train(model: MemoryLM, data: torch.Tensor, steps: int, batch: int = 16, length: int = 64,
          show_progress: bool = True) -> float:
    from tqdm import tqdm

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss = torch.tensor(float("nan"))
    for _ in tqdm(range(steps), desc="training", disable=not show_progress or steps == 0, dynamic_ncols=True):
        starts = torch.randint(0, len(data) - length - 1, (batch,))
        window = torch.stack([data[s:s + length + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="no training, shorter generation (seconds)")
    parser.add_argument("--steps", type=int, default=200, help="training steps before exporting")
    parser.add_argument("--tokens", type=int, default=120, help="characters generated per prompt")
    parser.add_argument("--out", default=None, help="folder for the ONNX files (default: a temporary one)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    steps, n_tokens = (0, 40) if args.quick else (args.steps, args.tokens)

    torch.manual_seed(args.seed)
    text, chars = load_text()
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text])
    model = MemoryLM(len(chars))
    if steps:
        print(f"final training loss {train(model, data, steps, show_progress=not args.no_progress):.3f} nats/char")
    model.eval()

    prompts = ["The ", "for x in ", "Returns a"]
    width = max(map(len, prompts))  # one batch: left-pad with spaces to the same length
    batch = torch.tensor([[index[c] for c in p.rjust(width)] for p in prompts])
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.out or tmp
        os.makedirs(directory, exist_ok=True)
        prefill_path, decode_path = export(model, directory)
        t0 = time.perf_counter()
        onnx_tokens = generate_onnx(prefill_path, decode_path, batch.numpy(), n_tokens)
        seconds = time.perf_counter() - t0
    torch_tokens = generate_torch(model, batch, n_tokens).numpy()
    for prompt, row in zip(prompts, onnx_tokens):
        print(repr(prompt + "".join(chars[i] for i in row)))
    same = np.array_equal(onnx_tokens, torch_tokens)
    print(f"onnxruntime: {onnx_tokens.size} tokens in {seconds:.2f} s; "
          f"same tokens as PyTorch: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
