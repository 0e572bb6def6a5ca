"""The follow protocol: tensor parallelism with rank 0 driving and ranks 1..N-1 replaying its steps
(docs/architecture.md, "Tensor parallelism")."""
