-- Write a result record once (first write wins): write_once_body, returning whether it wrote.
--! include write_once_body
return wrote
