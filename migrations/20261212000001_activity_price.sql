-- What one unit of the sale costs, in the currency's minor units (cents for
-- usd, yen for jpy), and that currency (ISO 4217, lower case). Both NULL for a
-- sale without a price; the service writes both or neither.
ALTER TABLE activities
    ADD COLUMN price BIGINT NULL,
    ADD COLUMN currency CHAR(3) CHARACTER SET ascii NULL;
