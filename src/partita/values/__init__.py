"""The value layer: the data every stage shares, importing no stage.

``mesh`` (Mesh, HybridMesh), ``spec`` (P, Sharding), ``layout`` (shard arithmetic), ``tensor``
(ShardedTensor and its annotations), ``tensor_ops`` (its torch-operator surface),
``annotations`` (the rules of marking a tensor), ``serialization`` (torch.load of these values).
"""
