# The four evaluation files of ../shared/data (see its README); sourced by the study scripts.
D=${DATA:-../shared/data}
HOT=$D/hotpotqa/hotpotqa_dev_distractor_first20.jsonl
WIKI=$D/2wikimqa/2wikimqa_dev_bm25_hipporag.jsonl
MUS=$D/musique/musique_dev_paragraphs_kag.jsonl
TRI=$D/triviaqa/triviaqa_dev_searchr1_e5_wiki18.jsonl
