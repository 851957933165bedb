from evictlab.data.corpora import CorpusKind, DatasetConfig, Document, load_documents, split_documents
from evictlab.data.dataset import Corpus, TokenSplit, load_corpus
from evictlab.data.tokenizers import TokenizerConfig, TokenizerKind

__all__ = [
    "Corpus",
    "CorpusKind",
    "DatasetConfig",
    "Document",
    "TokenSplit",
    "TokenizerConfig",
    "TokenizerKind",
    "load_corpus",
    "load_documents",
    "split_documents",
]
