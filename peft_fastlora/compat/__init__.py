"""Every access to private parts of PEFT, transformers and torch, and every difference between their
versions, one module per upstream. The rest of the package asks these helpers.

From the bottom up (each imports only modules above it in this list): ``modules`` (torch modules
and tensors, transformers models' attributes and limits), ``graphs`` (torch's CUDA graphs),
``peft`` (PEFT's LoRA layers and hooks), ``tensor_parallel`` (torch's and transformers' tensor
parallelism), ``adapters`` (what fastlora reads of a LoRA layer's adapters), ``attention``
(transformers' attention registries, torch's flash varlen kernel), ``generate`` (transformers'
generate and static cache), ``engine`` (transformers' continuous batching) and ``tokenizers``
(transformers' tokenizers' decoding).

Each helper checks what it relies on (a feature probe) and, where that no longer holds, either
says so in a clear error naming the version, or answers so that fastlora leaves the feature to
PEFT / transformers (with the reason in the patch report).
"""
