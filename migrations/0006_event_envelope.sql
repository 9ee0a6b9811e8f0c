-- The outbox event envelope, built in one place.
--
-- Every outbox event body starts with the same six keys (event, dlq_id, table, doc_id,
-- chunk_index, generation) followed by keys of its own. Seven statements built that envelope
-- by hand; they now call this function with their own keys in `extra`. It lives in the
-- schema rather than as a Rust-side SQL fragment because the hot statements (park, store) are
-- constant strings, and because one definition next to the tables is what an operator writing
-- a repair by hand would find.
--
-- jsonb keeps one canonical key order, so `envelope || extra` is byte for byte the body the
-- single jsonb_build_object gave (consumers read these bodies as they are). STABLE, like
-- jsonb_build_object: a one-expression SQL function of that volatility is inlined by the
-- planner, so the statements cost what they cost before.
CREATE FUNCTION embed_dlq_event(event text, dlq_id bigint, target_table text, doc_id text,
                                chunk_index int, generation bigint, extra jsonb)
    RETURNS jsonb LANGUAGE sql STABLE PARALLEL SAFE
    RETURN jsonb_build_object('event', event, 'dlq_id', dlq_id, 'table', target_table,
                              'doc_id', doc_id, 'chunk_index', chunk_index, 'generation', generation)
           || COALESCE(extra, '{}'::jsonb);
