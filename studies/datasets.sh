# The evaluation files of ../shared/data (see its README); sourced by the study scripts.
# HotpotQA: the main study uses HippoRAG's 100 distractor questions (train split, gold paragraphs
# always present) because the only dev distractor file has 20 questions; those 20 are kept as a
# cross-check in studies/quality/results/hotpotqa_dev20 (a dataset name must map to one file per folder).
D=${DATA:-../shared/data}
HOT=$D/hotpotqa/hotpotqa_train_distractor_hipporag.jsonl
HOT_DEV20=$D/hotpotqa/hotpotqa_dev_distractor_first20.jsonl
WIKI=$D/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl
MUS=$D/musique/musique_dev_paragraphs_kag.jsonl
TRI=$D/triviaqa/triviaqa_dev_searchr1_e5_wiki18.jsonl
