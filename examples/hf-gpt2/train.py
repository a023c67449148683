"""A user's own elastic training script: a Hugging Face GPT-2 (random init, head tied to the
embedding) sharded with ZeRO-3, on dtjob's built-in text corpus (bytes as tokens).

    python examples/hf-gpt2/train.py --steps 100        # one process
    torchrun --nproc-per-node 2 examples/hf-gpt2/train.py
As a DistributedTrainingJob: examples/hf-gpt2/job.yaml. The elastic contract (resume at any world
size, SIGTERM -> checkpoint -> exit 75, the operator's metrics) comes from ElasticSession.
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dtjob.trainer import ElasticSession, full_state_dict, fully_shard
from dtjob.trainer.data import Corpus, TokenWindows

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--global-batch-size", type=int, default=24)
parser.add_argument("--checkpoint-every", type=int, default=20)
parser.add_argument("--log-file", default=None)
args = parser.parse_args()

session = ElasticSession(checkpoint_every=args.checkpoint_every, log_file=args.log_file)
config = GPT2Config(
    vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
)
model = fully_shard(GPT2LMHeadModel(config).to(session.device), zero_stage=3)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / 10))
session.track(model, optimizer, scheduler)

data = TokenWindows(Corpus.load(None), seq_len=64)
sampler = session.batch_sampler(data, args.global_batch_size, shuffle="replacement")
for step in session.steps(args.steps):  # resumes after the newest checkpoint; exits 75 on SIGTERM
    ids = session.to_device(torch.stack([data[i][0] for i in sampler.indices(step)]))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    session.report(loss)

weights = full_state_dict(model)  # the plain model's weights, on rank 0
if session.rank == 0 and session.checkpoint_dir is not None:
    torch.save(weights, session.checkpoint_dir / "final-weights.pt")
session.close()
