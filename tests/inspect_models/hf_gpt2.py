"""A Hugging Face model as people use it: the library's class and a config, nothing else."""
from transformers import GPT2Config, GPT2LMHeadModel

config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64,
                    bos_token_id=0, eos_token_id=0)
