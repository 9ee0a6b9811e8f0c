//! Documents to chunks: a table source whose rows hold whole documents (`source add-table
//! --chunk-chars N` or `--chunk-tokens N`) cuts each one with `text-splitter`, at the largest
//! semantic unit that fits (Markdown's structure first when asked, then paragraphs,
//! sentences, words), chunk 0 first.
//!
//! The cut is a function of the text alone, so an unchanged document gives the same chunks
//! (skipped as unchanged, no provider call) and an edit changes the chunks from the edited
//! part on; what a shorter document no longer has is deleted by the follower
//! (`table::trailing_deletes`).

use text_splitter::{Characters, ChunkConfig, MarkdownSplitter, TextSplitter};
use tiktoken_rs::CoreBPE;

use crate::store::table_source::{ChunkUnit, Chunking};

/// A configured cut.
pub(crate) enum Splitter {
    Chars(TextSplitter<Characters>),
    CharsMarkdown(MarkdownSplitter<Characters>),
    Tokens(TextSplitter<&'static CoreBPE>),
    TokensMarkdown(MarkdownSplitter<&'static CoreBPE>),
}

impl Splitter {
    /// The cut `chunking` describes; its bounds are checked when the source is added, and a
    /// value out of them (a hand-edited row) is refused here.
    pub(crate) fn new(chunking: &Chunking) -> Result<Splitter, String> {
        if let Some(problem) = chunking.problem() {
            return Err(problem);
        }
        let config = ChunkConfig::new(chunking.size as usize)
            .with_overlap(chunking.overlap as usize)
            .map_err(|e| e.to_string())?;
        Ok(match (chunking.unit, chunking.markdown) {
            (ChunkUnit::Chars, false) => Splitter::Chars(TextSplitter::new(config)),
            (ChunkUnit::Chars, true) => Splitter::CharsMarkdown(MarkdownSplitter::new(config)),
            (ChunkUnit::Tokens, markdown) => {
                let config = config.with_sizer(tiktoken_rs::cl100k_base_singleton());
                match markdown {
                    false => Splitter::Tokens(TextSplitter::new(config)),
                    true => Splitter::TokensMarkdown(MarkdownSplitter::new(config)),
                }
            }
        })
    }

    /// The document's chunks in order. Never empty: a document with no text is one empty
    /// chunk, which the pipeline parks as empty input (a DLQ row, not a silent nothing).
    pub(crate) fn split(&self, text: &str) -> Vec<String> {
        let chunks: Vec<String> = match self {
            Splitter::Chars(s) => s.chunks(text).map(str::to_owned).collect(),
            Splitter::CharsMarkdown(s) => s.chunks(text).map(str::to_owned).collect(),
            Splitter::Tokens(s) => s.chunks(text).map(str::to_owned).collect(),
            Splitter::TokensMarkdown(s) => s.chunks(text).map(str::to_owned).collect(),
        };
        if chunks.is_empty() { vec![text.to_owned()] } else { chunks }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chars(size: u32, overlap: u32, markdown: bool) -> Splitter {
        Splitter::new(&Chunking { unit: ChunkUnit::Chars, size, overlap, markdown }).unwrap()
    }

    fn document(paragraphs: usize) -> String {
        (0..paragraphs)
            .map(|p| format!("Paragraph {p} says something about topic {p}. It has a second sentence too."))
            .collect::<Vec<_>>()
            .join("\n\n")
    }

    #[test]
    fn chunks_fit_their_size_and_an_edit_at_the_end_keeps_the_chunks_before_it() {
        let splitter = chars(200, 0, false);
        let text = document(40);
        let chunks = splitter.split(&text);
        assert!(chunks.len() > 5, "{}", chunks.len());
        assert!(chunks.iter().all(|c| c.chars().count() <= 200));
        assert_eq!(splitter.split(&text), chunks, "the cut is a function of the text");
        let edited = format!("{text} An added last sentence.");
        let after = splitter.split(&edited);
        let same = chunks.iter().zip(&after).take_while(|(a, b)| a == b).count();
        assert!(same >= chunks.len() - 1, "{same} of {} chunks kept", chunks.len());
        let shorter = splitter.split(&document(20));
        assert!(shorter.len() < chunks.len());
        assert_eq!(shorter[..shorter.len() - 1], chunks[..shorter.len() - 1]);
    }

    #[test]
    fn tokens_count_cl100k_base_tokens_and_markdown_cuts_at_headings() {
        let tokens =
            Splitter::new(&Chunking { unit: ChunkUnit::Tokens, size: 32, overlap: 0, markdown: false })
                .unwrap();
        let bpe = tiktoken_rs::cl100k_base_singleton();
        let chunks = tokens.split(&document(30));
        assert!(chunks.len() > 10);
        assert!(chunks.iter().all(|c| bpe.encode_ordinary(c).len() <= 32));
        let md = chars(120, 0, true)
            .split("# One\n\nFirst part of the text.\n\n# Two\n\nSecond part of the text.");
        assert_eq!(md.len(), 1, "fits whole: {md:?}");
        let md =
            chars(40, 0, true).split("# One\n\nFirst part of the text.\n\n# Two\n\nSecond part of the text.");
        assert!(md.iter().any(|c| c.starts_with("# Two")), "{md:?}");
    }

    #[test]
    fn an_empty_document_is_one_empty_chunk_and_bad_settings_are_refused() {
        assert_eq!(chars(100, 0, false).split("   "), vec!["   ".to_owned()]);
        assert_eq!(chars(100, 0, false).split(""), vec![String::new()]);
        for bad in [
            Chunking { unit: ChunkUnit::Chars, size: 100, overlap: 100, markdown: false },
            Chunking { unit: ChunkUnit::Chars, size: 1, overlap: 0, markdown: false },
            Chunking { unit: ChunkUnit::Tokens, size: 9_000, overlap: 0, markdown: false },
        ] {
            assert!(Splitter::new(&bad).is_err(), "{bad:?}");
        }
    }
}
