"""What each task adds to the pipeline: rerank pairs and ranking (rerank.py), classification
(classify.py), sparse vectors (sparse_vectors.py), token vectors (token_vectors.py) and BGE-M3's
outputs (bge_m3.py). May import the pipeline, observe and config.
"""
