"""n-gram speculative decoding (issue 31): config, prompt-lookup proposer, adaptive draft length, scheduler side. The verification lives in llmserve/sample/rejection_sampler.py."""
