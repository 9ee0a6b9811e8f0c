-- Every event carries `seq`: the order of one chunk's events, whatever order they reach the
-- stream in.
--
-- A chunk's events can reach the events stream out of order: `reconcile --repair` republishes
-- an event lost in Redis at the end of the stream, after the chunk's later events. Consumers
-- need a number to put them back in order. `seq` is the outbox row's id: every statement that
-- records an event (park, store, replay, operator actions, reconcile repairs) inserts its
-- outbox row after it has written (and so locked) the chunk's DLQ row, so the ids of one
-- chunk's events are drawn one after the other in the order those statements commit. A
-- republished event is the same outbox row: it keeps its `seq`. Compare `seq` only between
-- events of one chunk (target table, doc id, chunk index); across chunks it means nothing.
--
-- A row trigger rather than a change to the seven statements (and `embed_dlq_event`): the
-- row's id is known only once its identity default has been drawn, which a BEFORE trigger
-- sees and an expression of the INSERT does not. It touches events-stream rows only: replay
-- work items are read by the replayers, which need no order key. Rows written before this
-- migration have no `seq`; `tail` treats them as unordered.
CREATE FUNCTION embed_dlq_event_seq() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.body := NEW.body || jsonb_build_object('seq', NEW.id);
    RETURN NEW;
END $$;

CREATE TRIGGER dlq_outbox_event_seq BEFORE INSERT ON dlq_outbox
    FOR EACH ROW WHEN (NEW.stream = 'events') EXECUTE FUNCTION embed_dlq_event_seq();
