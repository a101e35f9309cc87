-- The draw's places are recorded in batches while the sale runs (its first
-- places are admitted meanwhile): how many are recorded so far, when the last
-- batch was, and which instance records them now (an instance taken over
-- records nothing more). `digest` fingerprints the draw's input, the early
-- joiners in arrival order, so an auditor (and an instance continuing the
-- draw) checks it was drawn from those joiners.
ALTER TABLE waiting_room_draws
    ADD COLUMN digest      CHAR(16)     NULL AFTER joined,
    ADD COLUMN recorded    INT UNSIGNED NOT NULL DEFAULT 0 AFTER digest,
    ADD COLUMN recorded_at DATETIME(3)  NULL AFTER drawn_at,
    ADD COLUMN recorder    CHAR(36)     NULL AFTER recorded_at;

-- Draws recorded before were recorded whole, at once.
UPDATE waiting_room_draws SET recorded = joined, recorded_at = drawn_at;
