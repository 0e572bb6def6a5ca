"""TensorFold's GLM-5.3-Flash family (HF `glm5_next`): KDA and MLA with the DSA pooled-key indexer, mHC, MoE."""
