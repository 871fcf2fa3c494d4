"""Knowledge base: chunking, embeddings, the vector index and the store facade (``knowledge.KnowledgeStore``)."""
