-- User ids as identity providers issue them (API.md version 4): up to 255 bytes
-- of UTF-8, compared byte for byte (`a`, `A` and `a ` are three users). A
-- binary type compares bytes and pads nothing; reads turn it back into text
-- (`CAST(user_id AS CHAR)`), which the service checked was UTF-8 on the way in.
ALTER TABLE orders
    MODIFY user_id VARBINARY(255) NOT NULL,
    MODIFY holder VARBINARY(255) AS (IF(status = 'failed', NULL, user_id)) STORED;

ALTER TABLE withdrawals
    MODIFY user_id VARBINARY(255) NOT NULL;

-- The waiting room's tables were made in the server's default character set,
-- whose default collation ignores case: activity ids `Sale` and `sale` (two
-- sales) shared their rows. Activity ids compare as the activities table does.
ALTER TABLE waiting_room_draws
    MODIFY activity_id VARCHAR(64) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL;

ALTER TABLE waiting_room_entries
    MODIFY activity_id VARCHAR(64) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL,
    MODIFY user_id VARBINARY(255) NOT NULL;

ALTER TABLE waiting_room_journal
    MODIFY activity_id VARCHAR(64) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL,
    MODIFY user_id VARBINARY(255) NOT NULL;

-- An operator's JWT subject is an id of the identity provider's too.
ALTER TABLE admin_audit
    MODIFY operator VARBINARY(255) NOT NULL,
    MODIFY activity_id VARCHAR(64) CHARACTER SET latin1 COLLATE latin1_general_cs NULL;
